"""The step's schedule decisions, made in one place: whether a unit keeps its full
parameters after forward, and which units a unit's gather prefetches.

Plain functions of plain facts, so the step (``unit.py``, ``runtime.py``) and the memory
planner's replay (``addons/planner/replay.py``) call the same code instead of each holding a copy
that a change to the step would have to update twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from fsdp_lite.core.api import PrefetchPolicy

T = TypeVar("T")


def keeps_full_after_forward(*, reshard_after_forward: bool | None, is_root: bool) -> bool:
    """After a forward that built a graph: keep the unit's full parameters for backward?

    ``reshard_after_forward`` True/False decides. ``None`` (default): the root keeps them
    (its backward runs first), every other unit frees them, as FSDP2 does. A unit kept
    from forward would sit at the step's highest point: the root's backward (the loss over
    the logits, the head's full gradient, every activation) runs before any other unit's.
    """
    if reshard_after_forward is not None:
        return not reshard_after_forward
    return is_root


def prefetch_targets(
    order: Sequence[T], index: int, prefetch: PrefetchPolicy | None, backward: bool
) -> list[T]:
    """The units the one at ``order[index]`` prefetches: the next ``max_in_flight - 1`` of
    the recorded ``order`` (its own gather is one in flight), if prefetching is on for
    this direction."""
    if prefetch is None or not (prefetch.backward if backward else prefetch.forward):
        return []
    return list(order[index + 1 : index + prefetch.max_in_flight])


def skips_prefetch(*, backward: bool, from_root: bool, target_started: bool) -> bool:
    """A prefetch target left alone: in backward, one whose backward already ran, and any
    target of the root's pre-backward (see ``keeps_full_after_forward``: it would be
    gathered at the step's highest point; it gathers at its own pre-backward instead)."""
    return backward and (from_root or target_started)
