"""TrainingState and checked transitions, and whether a backward is running.

IDLE -> FORWARD -> IDLE -> PRE_BACKWARD -> POST_BACKWARD -> IDLE, and
IDLE -> SUMMON_FULL_PARAMS -> IDLE. Root and non-root units share the enum.
"""

from __future__ import annotations

from enum import Enum, auto

import torch


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


class FSDPStateError(RuntimeError):
    """A unit was asked to do something its current TrainingState does not allow."""


def check_state(
    unit_name: str, actual: TrainingState, *expected: TrainingState, doing: str
) -> None:
    """Raise FSDPStateError naming the unit, its state and the states that were expected."""
    if actual in expected:
        return
    wanted = " or ".join(s.name for s in expected)
    raise FSDPStateError(
        f"fsdp_lite unit '{unit_name}' cannot {doing}: it is in state {actual.name}, "
        f"expected {wanted}"
    )


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1
