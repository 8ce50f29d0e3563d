"""Per-iteration runtime: pre/post-backward hooks and the end-of-backward callback.

Hooks open by checking the unit's TrainingState and return early when their work
is already done; only these functions and ``FSDPModule.forward`` move a unit
between states.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_map

from fsdp_lite.api import PrefetchPolicy
from fsdp_lite.flat_param import FlatParam, PendingGrad
from fsdp_lite.state import TrainingState, check_state

if TYPE_CHECKING:
    from fsdp_lite.fsdp import FSDPModule


@dataclass
class ExecOrder:
    """The order units ran in on the first pass; later passes prefetch along it.

    A pass that strays from the recorded order (data-dependent control flow) stops
    prefetching for the rest of that pass rather than gather the wrong unit.
    """

    recorded: list[FSDPModule] | None = None  # frozen after the first pass
    recording: list[FSDPModule] = field(default_factory=list)
    cursor: int = 0  # position of the next expected unit in this pass
    on_track: bool = False

    def start(self) -> None:
        self.cursor = 0
        self.on_track = self.recorded is not None

    def visit(self, unit: FSDPModule, ahead: int) -> list[FSDPModule]:
        """Note that ``unit`` runs now; return the ``ahead`` units expected next."""
        if self.recorded is None:
            self.recording.append(unit)
            return []
        if not self.on_track:
            return []
        if self.cursor < len(self.recorded) and self.recorded[self.cursor] is unit:
            self.cursor += 1
            return self.recorded[self.cursor : self.cursor + ahead]
        self.on_track = False
        return []

    def freeze(self) -> None:
        if self.recorded is None:
            self.recorded, self.recording = self.recording, []


@dataclass
class RootContext:
    """What the root owns for every unit of its tree, shared by reference."""

    units: list[FSDPModule]  # every unit in the root's tree, root first
    prefetch: PrefetchPolicy | None  # the root's policy applies to the whole tree
    callback_queued: bool = False  # the end-of-backward callback of this backward
    pending: list[PendingGrad] = field(default_factory=list)  # reduce-scatters in flight
    forward_order: ExecOrder = field(default_factory=ExecOrder)
    backward_order: ExecOrder = field(default_factory=ExecOrder)
    prefetched: set[FSDPModule] = field(default_factory=set)  # gathered ahead, not yet run

    def next_units(self, unit: FSDPModule, backward: bool) -> list[FSDPModule]:
        """Record ``unit`` in this pass's order and return the units to prefetch now."""
        order = self.backward_order if backward else self.forward_order
        policy = self.prefetch
        # A unit's own gather counts as one in flight: prefetch max_in_flight - 1 ahead.
        ahead = policy.max_in_flight - 1 if policy is not None else 0
        targets = order.visit(unit, ahead)
        if policy is None or not (policy.backward if backward else policy.forward):
            return []
        return [u for u in targets if u is not unit]


def unshard_with_prefetch(unit: FSDPModule, backward: bool) -> None:
    """Issue ``unit``'s gather, then the next units' gathers, then wait for ``unit``'s own."""
    ctx = unit._ctx
    ctx.prefetched.discard(unit)
    for flat in unit._flat_params:
        flat.unshard(async_op=True)
    for other in ctx.next_units(unit, backward):
        if backward and other._state is not TrainingState.IDLE:
            continue  # its backward already ran
        ctx.prefetched.add(other)
        for flat in other._flat_params:
            flat.unshard(async_op=True)
    for flat in unit._flat_params:
        flat.wait_unshard()


def reset(ctx: RootContext) -> None:
    """Forget an interrupted iteration: every unit resharded and IDLE, nothing in flight."""
    for pending in ctx.pending:
        with contextlib.suppress(Exception):
            pending.work.wait()
    ctx.pending.clear()
    for unit in ctx.units:
        unit._reshard()
        unit._state = TrainingState.IDLE
    ctx.prefetched.clear()
    ctx.callback_queued = False


def recover_if_interrupted(ctx: RootContext) -> None:
    """At the root's forward: if the last backward never finished (an exception inside it),
    reset, so the new iteration starts clean."""
    if in_backward():
        return
    in_backward_states = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
    if ctx.callback_queued or any(u._state in in_backward_states for u in ctx.units):
        warnings.warn(
            "fsdp_lite: the previous backward did not finish (did it raise?); resetting every "
            "unit to IDLE and dropping its unfinished gradient reductions",
            stacklevel=3,
        )
        reset(ctx)


def first_in_backward(unit: FSDPModule) -> bool:
    """Should ``unit`` stay gathered after forward, as the root does? Yes under the default
    ``reshard_after_forward=None`` with backward prefetching on, when this pass follows
    the recorded order and ``unit`` is the first after the root in the recorded backward
    order: backward would start by gathering it again (one gather and its wait saved)."""
    ctx = unit._ctx
    policy, recorded = ctx.prefetch, ctx.backward_order.recorded
    if unit._reshard_after_forward_arg is not None or policy is None or not policy.backward:
        return False
    if not recorded or not ctx.forward_order.on_track:
        return False
    return next((u for u in recorded if not u._is_root), None) is unit


def end_of_root_forward(ctx: RootContext) -> None:
    """Freeze the forward order after the first pass; free gathers nobody used."""
    ctx.forward_order.freeze()
    for unit in ctx.prefetched:
        if unit._state is TrainingState.IDLE:
            unit._reshard()
    ctx.prefetched.clear()


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


def register_pre_backward(unit: FSDPModule, output: Any) -> None:
    """Hook every output tensor that needs a gradient; the first to fire re-gathers."""
    tensors, _ = tree_flatten(output)
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(functools.partial(_pre_backward_hook, unit))


def _pre_backward_hook(unit: FSDPModule, grad: torch.Tensor) -> None:
    pre_backward(unit)


def pre_backward(unit: FSDPModule) -> None:
    """Re-gather ``unit``'s full parameters before its backward runs (once per backward)."""
    ctx = unit._ctx
    if not ctx.callback_queued:
        ctx.callback_queued = True
        ctx.backward_order.start()
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(finish_backward, ctx)
        )
    if unit._state is not TrainingState.IDLE:
        return
    with record_function("fsdp_lite::pre_backward"):
        unit._state = TrainingState.PRE_BACKWARD
        unshard_with_prefetch(unit, backward=True)


def post_backward(unit: FSDPModule, flat: FlatParam) -> None:
    """After ``flat``'s gradient is complete: reduce-scatter it (or keep it under no_sync)."""
    check_state(
        unit._unit_name,
        unit._state,
        TrainingState.PRE_BACKWARD,
        TrainingState.POST_BACKWARD,
        doing="run its post-backward hook (its pre-backward hook never ran: were its outputs "
        "detached or passed outside the autograd graph?)",
    )
    with record_function("fsdp_lite::post_backward"):
        unit._state = TrainingState.POST_BACKWARD
        if unit._sync_grads:
            wait_previous_reduce_scatter(unit._ctx)
            pending = flat.reduce_scatter_grad(unit._reduce_dtype(flat))
            if pending is not None:
                unit._ctx.pending.append(pending)
        else:
            flat.accumulate_unsharded()
        flat.reshard()


def wait_previous_reduce_scatter(ctx: RootContext) -> None:
    """Before a unit issues its reduce-scatter: wait for the one before it, so at most one
    is in flight. Until waited for, each holds memory the size of its full gradient
    (gloo's copy; NCCL's stashed input); the previous one had this unit's whole backward
    to finish. Only a local wait: results reach the shard grads at the end of backward,
    in issue order, so the ranks' collectives (the hybrid replicate all-reduce) keep the
    same order whatever the timing."""
    if ctx.pending:
        ctx.pending[-1].work.wait()  # every earlier one was waited for the same way


def finish_backward(ctx: RootContext) -> None:
    """End of backward: wait for every reduce-scatter, set shard grads, reshard, back to IDLE.

    Also covers units whose parameters got no gradient this iteration.
    """
    with record_function("fsdp_lite::finish_backward"):
        for pending in ctx.pending:
            pending.finish()
        ctx.pending.clear()
        homes = {id(f.home): f.home for u in ctx.units for f in u._flat_params}
        for home in homes.values():
            home.end_of_backward()
        for unit in ctx.units:
            unit._reshard()
            unit._state = TrainingState.IDLE
        ctx.prefetched.clear()
        ctx.backward_order.freeze()
        ctx.callback_queued = False
