"""Per-iteration runtime: pre/post-backward hooks and the end-of-backward callback.

Hooks open by checking the unit's TrainingState and return early when their work
is already done; only these functions and ``FSDPModule.forward`` move a unit
between states.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_map

from fsdp_lite.flat_param import FlatParam, PendingGrad
from fsdp_lite.state import TrainingState, check_state

if TYPE_CHECKING:
    from fsdp_lite.fsdp import FSDPModule


@dataclass
class RootContext:
    """What the root owns for every unit of its tree, shared by reference."""

    units: list[FSDPModule]  # every unit in the root's tree, root first
    callback_queued: bool = False  # the end-of-backward callback of this backward
    pending: list[PendingGrad] = field(default_factory=list)  # reduce-scatters in flight


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
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(finish_backward, ctx)
        )
    if unit._state is not TrainingState.IDLE:
        return
    with record_function("fsdp_lite::pre_backward"):
        unit._state = TrainingState.PRE_BACKWARD
        for flat in unit._flat_params:
            flat.unshard()


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
            pending = flat.reduce_scatter_grad(unit._reduce_dtype(flat))
            if pending is not None:
                unit._ctx.pending.append(pending)
        else:
            flat.accumulate_unsharded()
        flat.reshard()


def finish_backward(ctx: RootContext) -> None:
    """End of backward: wait for every reduce-scatter, set shard grads, reshard, back to IDLE.

    Also covers units whose parameters got no gradient this iteration.
    """
    with record_function("fsdp_lite::finish_backward"):
        for pending in ctx.pending:
            pending.finish()
        ctx.pending.clear()
        for unit in ctx.units:
            for flat in unit._flat_params:
                flat.reshard()
            unit._state = TrainingState.IDLE
        ctx.callback_queued = False
