"""Trace one training step of the unwrapped model on fake parameters: when each storage the
step allocates is live (``storage``), and where each unit's forward and backward
begin and end.

The model is not allocated: its parameters and buffers are ``FakeTensor``s on the compute
device (a meta-device model works), so every op picks the kernel and output shapes it would
pick for real (e.g. CPU flash attention, which saves a logsumexp). The example inputs stay
real where they can (not meta, and the device exists here): what the model computes from
them alone runs for real, so data-dependent code takes the path of a real step (Hugging
Face builds no causal mask for a plain batch, where for fake inputs it would); anything that
touches a parameter is fake from there on. Otherwise everything runs under ``FakeTensorMode``.

The parameters are replaced for the trace by views of one fake full buffer per flat param,
split and viewed as ``FlatParam.use_full_views`` does at every unit's forward: the graph then
has fsdp_lite's shape (each unit's parameter gradients wait in one split node and are
concatenated into a full-size gradient, which ends in a post-accumulate hook). Modules to
checkpoint run under non-reentrant ``torch.utils.checkpoint`` inside the unit's hooks, as
``FSDPModule(checkpoint_wrapper(block))`` does. Every replacement is undone when the trace
ends: the model's parameters, buffers and hooks are as they were, and so is the RNG.

What the trace counts, by category:

- ``activations``: storages made in forward (and recomputed in backward), the inputs included;
- ``full_gradients``: the unit's parameter gradients in the compute dtype (per-parameter
  pieces waiting for the split node, then the concatenated full gradient);
- ``backward_temporaries``: everything else made in backward (activation gradients).

The full buffers themselves, the buffers, and everything that lives outside the autograd
graph (shards, shard grads, optimizer state, communication buffers) are left to the replay
of fsdp_lite's step (``planner/replay.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from fsdp_lite.build.unit_init import install_fp32_modules
from fsdp_lite.core.nested import cast_floats, hook_gradient_nodes
from fsdp_lite.core.policies import MixedPrecision
from fsdp_lite.core.state import in_backward
from fsdp_lite.planner.layout import FlatLayout, UnitLayout
from fsdp_lite.planner.storage import (
    ACTIVATIONS,
    BACKWARD_TEMPORARIES,
    FULL_GRADIENTS,
    UNTRACED,
    Mark,
    StorageTracker,
)


@dataclass
class StepTrace:
    marks: list[Mark]
    buffer_bytes: int  # the model's buffers on the compute device (not in the marks)


def trace_step(
    model: nn.Module,
    example_inputs: tuple,
    units: list[UnitLayout],
    *,
    device: torch.device,
    mixed_precision: MixedPrecision | None,
    checkpointed: list[nn.Module],
    loss_fn: Callable[[Any], torch.Tensor],
) -> StepTrace:
    """Run forward, ``loss_fn`` and backward of ``model`` on fake parameters (see module doc)."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    tracker = StorageTracker()
    real = not any(_is_meta(x) for x in pytree.tree_leaves(example_inputs)) and (
        device.type == "cpu" or torch.cuda.is_available()
    )
    rng = torch.random.fork_rng(devices=[] if device.type == "cpu" else [device])
    with rng, contextlib.ExitStack() as undo:  # the caller's RNG state is left as it was
        with fake:
            fulls = [[_fake_full(f, device) for f in u.flats] for u in units]
            buffer_bytes = _swap_buffers(model, device, mixed_precision, undo)
        args = pytree.tree_map(
            functools.partial(_input, fake=None if real else fake, device=device), example_inputs
        )
        _swap_parameters(units, fulls, undo)
        _install_unit_hooks(units, fulls, mixed_precision, tracker, undo)
        for handle in install_fp32_modules(model.modules(), mixed_precision):
            undo.callback(handle.remove)
        for module in checkpointed:
            _checkpoint_forward(module, tracker, undo)
        mode = contextlib.nullcontext() if real else fake
        with mode, tracker, torch.enable_grad():
            for full in (t for per_unit in fulls for t in per_unit):
                tracker.track(full, UNTRACED)
            for t in pytree.tree_leaves(args):
                if isinstance(t, torch.Tensor):
                    tracker.track(t, ACTIVATIONS)
            tracker.mark("start", -1)
            loss = loss_fn(model(*args))
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                raise ValueError(
                    "estimate_memory: loss_fn(output) must return a tensor that requires grad"
                )
            tracker.phase = BACKWARD_TEMPORARIES
            loss.backward()
            tracker.mark("end", -1)
            del loss
    return StepTrace(tracker.marks(), buffer_bytes)


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


def _fake_full(flat: FlatLayout, device: torch.device) -> torch.Tensor:
    full = torch.empty(flat.padded_numel, dtype=flat.compute_dtype, device=device)
    return full.requires_grad_(flat.requires_grad)


def _input(x: Any, fake: FakeTensorMode | None, device: torch.device) -> Any:
    """A real input on the compute device (its values steer data-dependent code as in a
    real step, e.g. Hugging Face's mask building); a fake one where it cannot be real."""
    if not isinstance(x, torch.Tensor):
        return x
    if fake is None:
        return x.to(device)
    with fake:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)


def _swap_parameters(
    units: list[UnitLayout], fulls: list[list[torch.Tensor]], undo: contextlib.ExitStack
) -> None:
    """Put views of the fake full buffers where the parameters were (restored on exit)."""
    for unit in units:
        for flat in unit.flats:
            for slot in flat.slots:
                for module, attr in slot.locations:
                    original = module._parameters[attr]
                    undo.callback(module._parameters.__setitem__, attr, original)
    for unit, unit_fulls in zip(units, fulls, strict=True):
        for flat, full in zip(unit.flats, unit_fulls, strict=True):
            _use_views(flat, full, None)


def _use_views(flat: FlatLayout, full: torch.Tensor, tracker: StorageTracker | None) -> None:
    """``FlatParam.use_full_views``: one split (padding included), a view per parameter; the
    per-parameter gradients waiting in the split node are tagged as full gradients."""
    sizes = [s.shape.numel() for s in flat.slots] + [flat.padded_numel - flat.numel]
    pieces = torch.split(full, sizes)
    for slot, piece in zip(flat.slots, pieces, strict=False):
        if tracker is not None and piece.requires_grad:
            piece.register_hook(functools.partial(_tag_grad, tracker))
        view = piece.view(slot.shape)
        for module, attr in slot.locations:
            module._parameters[attr] = view


def _tag_grad(tracker: StorageTracker, grad: torch.Tensor | None) -> None:
    if grad is not None:
        tracker.tag(grad, FULL_GRADIENTS)


def _swap_buffers(
    model: nn.Module, device: torch.device, mp: MixedPrecision | None, undo: contextlib.ExitStack
) -> int:
    """Fake buffers on the compute device, in the dtype ``prepare_buffers`` gives them;
    returns their bytes (a buffer registered twice counts once)."""
    fakes: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is None:
                continue
            if id(buf) not in fakes:
                keep = (
                    mp is None
                    or mp.buffer_dtype is None
                    or isinstance(module, mp.fp32_module_types)
                )
                dtype = buf.dtype if keep or not buf.is_floating_point() else mp.buffer_dtype
                fakes[id(buf)] = torch.empty(buf.shape, dtype=dtype, device=device)
            undo.callback(module._buffers.__setitem__, name, buf)
            module._buffers[name] = fakes[id(buf)]
    return sum(t.untyped_storage().nbytes() for t in fakes.values())


def _install_unit_hooks(
    units: list[UnitLayout],
    fulls: list[list[torch.Tensor]],
    mp: MixedPrecision | None,
    tracker: StorageTracker,
    undo: contextlib.ExitStack,
) -> None:
    """Marks where fsdp_lite's unit hooks run: pre/post forward on the unit's module, pre
    backward on its outputs' gradient nodes, post backward when a full gradient is done."""
    for index, (unit, unit_fulls) in enumerate(zip(units, fulls, strict=True)):
        cast_to = mp.param_dtype if unit.is_root and mp is not None and mp.cast_inputs else None
        hooks = _UnitHooks(index, unit, unit_fulls, tracker, cast_to)
        module = unit.module
        handle = module.register_forward_pre_hook(hooks.pre_forward, prepend=True, with_kwargs=True)
        undo.callback(handle.remove)
        undo.callback(module.register_forward_hook(hooks.post_forward, with_kwargs=True).remove)
        for f, (flat, full) in enumerate(zip(unit.flats, unit_fulls, strict=True)):
            if flat.requires_grad:
                full.register_post_accumulate_grad_hook(
                    functools.partial(_post_backward, tracker, index, f)
                )


@dataclass
class _UnitHooks:
    index: int
    unit: UnitLayout
    fulls: list[torch.Tensor]
    tracker: StorageTracker
    cast_to: torch.dtype | None  # the root casts float inputs (MixedPrecision.cast_inputs)

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if in_backward():  # a recompute: fsdp_lite treats it as the pre-backward
            self.tracker.mark("pre_backward", self.index)
            return None
        self.tracker.mark("pre_forward", self.index)
        for flat, full in zip(self.unit.flats, self.fulls, strict=True):
            _use_views(flat, full, self.tracker)
        return cast_floats((args, kwargs), self.cast_to) if self.cast_to is not None else None

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if in_backward():
            return
        self.tracker.mark("post_forward", self.index)
        if torch.is_grad_enabled():
            mark = functools.partial(self.tracker.mark, "pre_backward", self.index)
            hook_gradient_nodes(out, lambda *_: mark())  # as the root hooks outputs


def _post_backward(tracker: StorageTracker, unit: int, flat: int, full: torch.Tensor) -> None:
    tracker.tag(full.grad, FULL_GRADIENTS)
    tracker.mark("post_backward", unit, flat)
    full.grad = None  # FlatParam.take_grad


def _checkpoint_forward(
    module: nn.Module, tracker: StorageTracker, undo: contextlib.ExitStack
) -> None:
    """Run ``module``'s forward under non-reentrant checkpointing (inside its hooks)."""
    had = "forward" in module.__dict__
    original = module.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        if not in_backward():
            return original(*args, **kwargs)
        previous, tracker.phase = tracker.phase, ACTIVATIONS  # recomputed activations
        try:
            return original(*args, **kwargs)
        finally:
            tracker.phase = previous

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    module.forward = forward
    if had:
        undo.callback(setattr, module, "forward", original)
    else:
        undo.callback(module.__dict__.pop, "forward", None)
