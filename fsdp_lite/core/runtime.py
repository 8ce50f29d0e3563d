"""What the root owns for its whole tree, per iteration: the recorded unit orders that
prefetching follows, the reduce-scatters in flight, and the end-of-backward callback.

The step of one unit is in ``unit.py``; it and these functions move a unit between
TrainingStates in training, and ``addons/summon.py`` in and out of SUMMON_FULL_PARAMS.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from fsdp_lite.core import accounting, schedule
from fsdp_lite.core.api import PrefetchPolicy
from fsdp_lite.core.flat_param import PendingGrad
from fsdp_lite.core.state import TrainingState

if TYPE_CHECKING:
    from fsdp_lite.core.unit import Unit


@dataclass
class ExecOrder:
    """The order units ran in on the last pass that set it; passes prefetch along it.

    A pass that strays from the recorded order (data-dependent control flow, a first
    pass that was a warm-up or ran part of the model) stops prefetching for the rest of
    that pass, and its own order replaces the recorded one when it ends: prefetching
    follows the order once it is stable. A pass that runs a prefix of it (an early exit)
    keeps it. Each replacement is counted in ``stats()["order_changes"]``.
    """

    direction: str  # "forward" or "backward", for stats()
    recorded: list[Unit] | None = None
    recording: list[Unit] = field(default_factory=list)  # this pass's, once it strayed
    cursor: int = 0  # position of the next expected unit in this pass
    on_track: bool = False

    def start(self) -> None:
        self.cursor = 0
        self.on_track = self.recorded is not None
        self.recording = []

    def visit(self, unit: Unit) -> int | None:
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

    def freeze(self) -> None:
        """The pass is over: a first pass, or one that strayed, sets the order."""
        if self.recorded is not None and self.on_track:
            return
        if self.recorded is not None:
            accounting.order_changed(self.direction)
        self.recorded, self.recording = self.recording, []
        self.on_track = False


@dataclass
class RootContext:
    """What the root owns for every unit of its tree, shared by reference."""

    units: list[Unit]  # every unit in the root's tree, root first
    prefetch: PrefetchPolicy | None  # the root's policy applies to the whole tree
    callback_queued: bool = False  # the end-of-backward callback of this backward
    pending: list[PendingGrad] = field(default_factory=list)  # reduce-scatters in flight
    forward_order: ExecOrder = field(default_factory=lambda: ExecOrder("forward"))
    backward_order: ExecOrder = field(default_factory=lambda: ExecOrder("backward"))
    prefetched: set[Unit] = field(default_factory=set)  # gathered ahead, not yet run

    def next_units(self, unit: Unit, backward: bool) -> list[Unit]:
        """Record ``unit`` in this pass's order and return the units to prefetch now."""
        order = self.backward_order if backward else self.forward_order
        index = order.visit(unit)
        if index is None:
            return []
        targets = schedule.prefetch_targets(order.recorded, index, self.prefetch, backward)
        return [u for u in targets if u is not unit]


def reset(ctx: RootContext) -> None:
    """Forget an interrupted iteration: every unit resharded and IDLE, nothing in flight."""
    for pending in ctx.pending:
        with contextlib.suppress(Exception):
            pending.wait()
    ctx.pending.clear()
    for unit in ctx.units:
        unit.end_backward()
        for flat in unit.flat_params:
            if flat.full is not None:
                flat.full.grad = None
    ctx.prefetched.clear()
    ctx.callback_queued = False


def recover_if_interrupted(ctx: RootContext) -> None:
    """At the root's forward: if the last backward never finished (an exception inside it),
    reset, so the new iteration starts clean."""
    if in_backward():
        return
    in_backward_states = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
    if ctx.callback_queued or any(u.state in in_backward_states for u in ctx.units):
        warnings.warn(
            "fsdp_lite: the previous backward did not finish (did it raise?); resetting every "
            "unit to IDLE and dropping its unfinished gradient reductions",
            stacklevel=3,
        )
        reset(ctx)


def free_kept(ctx: RootContext) -> None:
    """At the root's forward: free full parameters kept from the last forward (the root's,
    ``reshard_after_forward=False``) whose backward never came -- a validation forward with
    grad enabled. Kept full parameters live until their forward's backward ends or the next
    root forward begins, so none is ever used after the optimizer (or a load, an EMA, a
    ``p.data`` write) changed the shards it was gathered from. A backward of that earlier
    forward still to come gathers them again, into the same storage its graph saved."""
    for unit in ctx.units:
        if unit.state is TrainingState.IDLE:
            unit.reshard()


def end_of_root_forward(ctx: RootContext) -> None:
    """Freeze the forward order after the first pass; free gathers nobody used; let every
    home settle its forward's copies (a forward need not be followed by a backward: the
    optimizer may write offloaded shards next)."""
    ctx.forward_order.freeze()
    for unit in ctx.prefetched:
        if unit.state is TrainingState.IDLE:
            unit.reshard()
    ctx.prefetched.clear()
    for home in _homes(ctx):
        home.end_of_forward()


def _homes(ctx: RootContext) -> list:
    """The root's homes, each once (units may share one)."""
    return list({id(f.home): f.home for u in ctx.units for f in u.flat_params}.values())


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a nested structure to ``dtype``."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def check_no_unreduced_grads(ctx: RootContext) -> None:
    """At the root's forward: a gradient kept by ``Unit.post_backward`` in IDLE that no
    backward reduced would silently miss the step it belongs to."""
    for unit in ctx.units:
        for flat in unit.flat_params:
            if flat.full is not None and flat.full.grad is not None:
                flat.full.grad = None
                raise RuntimeError(
                    f"fsdp_lite: unit '{unit.name}' got a gradient in a backward that did not "
                    "pass through its outputs (one of its modules called outside its forward, "
                    "e.g. a loss through the root's head), and no backward through its outputs "
                    "followed before this forward: the gradient was never averaged across "
                    "ranks and did not reach the last step. Call backward through the output "
                    "of the model's forward (h.backward(grad_h)) after such partial backwards; "
                    "the gradient has been dropped"
                )


def wait_previous_reduce_scatter(ctx: RootContext) -> None:
    """Before a unit issues its reduce-scatter: wait for the one before it, so at most one
    is in flight. Until waited for, each holds memory the size of its full gradient
    (gloo's copy; NCCL's stashed input); the previous one had this unit's whole backward
    to finish. With hybrid sharding its replicate all-reduce starts then, overlapping this
    unit's backward instead of waiting for the end of backward. Results reach the shard
    grads at the end of backward, in issue order; every rank issues the same collectives
    in the same order whatever the timing."""
    if ctx.pending:
        ctx.pending[-1].replicate()  # every earlier one was waited for the same way


def finish_backward(ctx: RootContext) -> None:
    """End of backward: wait for every reduce-scatter, set shard grads, reshard, back to IDLE.

    Also covers units whose parameters got no gradient this iteration.
    """
    with accounting.region("fsdp_lite::finish_backward"):
        for unit in ctx.units:  # gradients no post-backward hook of this backward took
            for flat in unit.flat_params:
                unit.post_backward(flat, at_end=True)
        for pending in ctx.pending:
            pending.finish()
        ctx.pending.clear()
        for home in _homes(ctx):
            home.end_of_backward()
        for unit in ctx.units:
            for flat in unit.flat_params:
                flat.link_orig_grads()  # the optimizer's parameters see the new grads
        for unit in ctx.units:
            unit.end_backward()
        ctx.prefetched.clear()
        ctx.backward_order.freeze()
        ctx.callback_queued = False
