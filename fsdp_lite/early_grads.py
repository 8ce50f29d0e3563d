"""Reducing a large gradient as soon as it is complete, where its unit's comes much later.

A unit with nested units (the root) reduce-scatters its gradient at its post-backward, the
last event of backward: its embedding's gradient completes only after every block's
backward. But its ``lm_head``'s -- untied, or the head's half of a tied embedding -- is
complete after the first node of backward, and waited, full-size, in the split node's
input buffer through the whole backward (a 50k x 2048 bf16 head: 0.19 GiB per rank, at
every W; Llama-3's 128k x 4096: 1 GiB).

Here each place (module, attribute) of a large parameter of such a unit
(``EARLY_REDUCE_BYTES`` and up) gets, by a forward pre-hook on that module, a fresh alias
of the parameter's view through :class:`_ReduceOnArrival` just before the module runs.
Made then, its autograd node is newer than every block's, so backward runs it as soon as
that place's gradient is complete (the engine runs the newest ready node first; an alias
made at the unit's own pre-forward would wait behind every block). If no nested unit's
backward has started yet (the module ran after them in forward), it takes that gradient
out of the graph (passes nothing on) and the next unit's pre-backward reduce-scatters it
alone (``runtime.reduce_arrived``; ``FlatParam.reduce_scatter_slot``: zeros elsewhere, in
pieces, no full-size buffer), right after the unit's full parameters were freed there
(``saved_views.py``): reduced inside the node, its pieces sat beside the gathered root,
the gradient and every activation, the step's highest point (1.3B GPT, W=64: 1.04 GiB
against 0.99 without any early reduce); the rest of the unit's gradient (the embedding's
part, zeros at that place) is reduced at its post-backward as before, and both add into
the shard grad. A gradient that arrives later, under ``no_sync``, or from a use outside
the module's own forward goes on the usual way. The price is one more reduce-scatter of
the unit per step, taken only where the gradient is at least one reduce piece (64 MiB),
and overlapped with the blocks' backward.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdp_lite import flat_param
from fsdp_lite.state import TrainingState

if TYPE_CHECKING:
    from fsdp_lite.unit import Unit

EARLY_REDUCE_BYTES = flat_param.WIDEN_PIECE_BYTES


def is_large(numel: int, compute_dtype: torch.dtype) -> bool:
    """Is a parameter of ``numel`` elements gathered in ``compute_dtype`` reduced early?"""
    return numel * compute_dtype.itemsize >= EARLY_REDUCE_BYTES


def install(unit: Unit, nested: list[Unit]) -> None:
    """Hook the modules that hold a large trainable parameter of ``unit``."""
    aliaser = _Aliaser(weakref.ref(unit), [weakref.ref(u) for u in nested])
    for flat in unit.flat_params:
        if not flat.requires_grad:
            continue
        for index, slot in enumerate(flat.slots):
            if not is_large(slot.numel, flat.compute_dtype):
                continue
            for module, attr in slot.locations:
                hook = functools.partial(aliaser.before_use, weakref.ref(flat), index, attr)
                module.register_forward_pre_hook(hook)


class _Aliaser:
    """The forward pre-hooks' and the aliases' view of the unit."""

    def __init__(self, unit: weakref.ref, nested: list[weakref.ref]) -> None:
        self.unit, self.nested = unit, nested

    def before_use(
        self, flat: weakref.ref, index: int, attr: str, module: nn.Module, args: tuple
    ) -> None:
        unit = self.unit()
        view = module.__dict__.get(attr)
        if unit is None or unit.state is not TrainingState.FORWARD or not torch.is_grad_enabled():
            return
        if type(view) is torch.Tensor and view.requires_grad:
            module.__dict__[attr] = _ReduceOnArrival.apply(view, self, flat, index)

    def early(self) -> Unit | None:
        """The unit, if a gradient arriving now is to be reduced at once."""
        unit = self.unit()
        if unit is None or not unit.sync_grads or not unit.in_backward():
            return None
        if any(n() is not None and n().in_backward() for n in self.nested):
            return None
        return unit


class _ReduceOnArrival(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, view: torch.Tensor, aliaser: _Aliaser, flat: Any, index: int) -> Any:
        ctx.aliaser, ctx.flat, ctx.index = aliaser, flat, index
        return view.view_as(view)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        unit = ctx.aliaser.early()
        flat = ctx.flat()
        if unit is None or flat is None:
            return grad, None, None, None
        unit.ctx.arrived.append((unit, flat, ctx.index, grad))  # runtime.reduce_arrived
        return None, None, None, None
