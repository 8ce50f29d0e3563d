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


def keeps_full_after_forward(
    *,
    reshard_after_forward: bool | None,
    is_root: bool,
    prefetch: PrefetchPolicy | None,
    first_in_backward: bool,
    on_track: bool,
    outweighs_masters: bool,
) -> bool:
    """After a forward that built a graph: keep the unit's full parameters for backward?

    ``reshard_after_forward`` True/False decides. ``None`` (default): the root keeps them
    (its backward runs first), every other unit frees them -- except, with backward
    prefetching on and this pass following the recorded order (``on_track``), the first
    unit after the root in the recorded backward order (``first_in_backward``: a
    transformer's last block), which backward would start by gathering again. Not where
    its full parameters outweigh this rank's whole fp32 master copy
    (``outweighs_masters``; large W): kept, or prefetched by the root's pre-backward, they
    would sit beside the gathered root, its head's full gradient and every activation at
    the step's highest point, for one gather a step.
    """
    if reshard_after_forward is not None:
        return not reshard_after_forward
    if is_root:
        return True
    if prefetch is None or not prefetch.backward or not on_track:
        return False
    return first_in_backward and not outweighs_masters


def prefetch_targets(
    order: Sequence[T], index: int, prefetch: PrefetchPolicy | None, backward: bool
) -> list[T]:
    """The units the one at ``order[index]`` prefetches: the next ``max_in_flight - 1`` of
    the recorded ``order`` (its own gather is one in flight), if prefetching is on for
    this direction."""
    if prefetch is None or not (prefetch.backward if backward else prefetch.forward):
        return []
    return list(order[index + 1 : index + prefetch.max_in_flight])


def skips_prefetch(
    *, backward: bool, from_root: bool, target_started: bool, target_outweighs: bool
) -> bool:
    """A prefetch target left alone: in backward, one whose backward already ran, and,
    from the root, one whose full parameters outweigh the master shards (see
    ``keeps_full_after_forward``)."""
    return backward and (target_started or (from_root and target_outweighs))
