"""The step's schedule: the unit orders a root records, and the frozen ``Schedule`` it
builds from them -- per unit, whether it keeps its full parameters after forward, and per
position of each order, which units that gather prefetches.

Built by one function from plain facts, so the step (``root.py``) and the memory
planner's replay (``planner/replay.py``) follow the same schedule instead of each
holding a copy of its rules.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from fsdp_lite.core import accounting
from fsdp_lite.core.policies import PrefetchPolicy

T = TypeVar("T", bound=Hashable)


@dataclass(frozen=True)
class Schedule(Generic[T]):
    """What the step does, fixed until a recorded order changes."""

    keeps_full: frozenset[T]  # keep full parameters after a forward that built a graph
    forward_prefetch: tuple[tuple[T, ...], ...]  # per position of the forward order
    backward_prefetch: tuple[tuple[T, ...], ...]  # per position of the backward order

    def prefetches(self, index: int | None, backward: bool) -> tuple[T, ...]:
        """The units the gather at position ``index`` of this pass's order prefetches
        (``None``: the pass strayed from the recorded order, so none)."""
        if index is None:
            return ()
        return (self.backward_prefetch if backward else self.forward_prefetch)[index]


def build(
    units: Sequence[T],
    root: T,
    reshard_after_forward: Callable[[T], bool | None],
    forward: Sequence[T],
    backward: Sequence[T],
    prefetch: PrefetchPolicy | None,
) -> Schedule[T]:
    """The schedule of ``root``'s tree of ``units`` for the recorded orders.

    Keeping full parameters after forward: ``reshard_after_forward`` True/False decides;
    ``None`` (default): the root keeps them (its backward runs first), every other unit
    frees them, as FSDP2 does. A unit kept from forward would sit at the step's highest
    point: the root's backward (the loss over the logits, the head's full gradient, every
    activation) runs before any other unit's.

    Prefetching: a gather issues the next ``max_in_flight - 1`` units of the order (its own
    gather is one in flight), if the policy prefetches in that direction. The root's
    pre-backward prefetches nothing, for the same reason the others free after forward:
    it runs at the step's highest point; each unit gathers at its own pre-backward then.
    """
    keeps = frozenset(u for u in units if _keeps_full(reshard_after_forward(u), u == root))
    forward_prefetch = _prefetches(forward, prefetch, backward=False, root=root)
    backward_prefetch = _prefetches(backward, prefetch, backward=True, root=root)
    return Schedule(keeps, forward_prefetch, backward_prefetch)


def _keeps_full(reshard_after_forward: bool | None, is_root: bool) -> bool:
    if reshard_after_forward is not None:
        return not reshard_after_forward
    return is_root


def _prefetches(
    order: Sequence[T], prefetch: PrefetchPolicy | None, backward: bool, root: T
) -> tuple[tuple[T, ...], ...]:
    on = prefetch is not None and (prefetch.backward if backward else prefetch.forward)
    out = []
    for i, unit in enumerate(order):
        if not on or (backward and unit == root):
            out.append(())
            continue
        ahead = order[i + 1 : i + prefetch.max_in_flight]
        out.append(tuple(u for u in ahead if u != unit))
    return tuple(out)


@dataclass
class ExecOrder(Generic[T]):
    """The order units ran in on the last pass that set it; passes prefetch along it.

    A pass that strays from the recorded order (data-dependent control flow, a first
    pass that was a warm-up or ran part of the model) stops prefetching for the rest of
    that pass, and its own order replaces the recorded one when it ends: prefetching
    follows the order once it is stable. A pass that runs a prefix of it (an early exit)
    keeps it. Each replacement is counted in ``stats()["order_changes"]``.
    """

    direction: str  # "forward" or "backward", for stats()
    ledger: accounting.Ledger  # the root's: counts each replacement
    recorded: list[T] | None = None
    recording: list[T] = field(default_factory=list)  # this pass's, once it strayed
    cursor: int = 0  # position of the next expected unit in this pass
    on_track: bool = False

    def start(self) -> None:
        self.cursor = 0
        self.on_track = self.recorded is not None
        self.recording = []

    def visit(self, unit: T) -> int | None:
        """Note that ``unit`` runs now; return its index in the recorded order (None off
        track)."""
        if not self.on_track:
            self.recording.append(unit)
            return None
        if self.cursor < len(self.recorded) and self.recorded[self.cursor] is unit:
            self.cursor += 1
            return self.cursor - 1
        self.on_track = False
        self.recording = [*self.recorded[: self.cursor], unit]
        return None

    def freeze(self) -> bool:
        """The pass is over: a first pass, or one that strayed, sets the order. Returns
        whether the recorded order changed (the schedule is rebuilt then)."""
        if self.recorded is not None and self.on_track:
            return False
        if self.recorded is not None:
            self.ledger.order_changed(self.direction)
        self.recorded, self.recording = self.recording, []
        self.on_track = False
        return True
