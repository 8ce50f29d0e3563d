"""Activation checkpointing that composes with FSDPModule, in either order.

Built on ``torch.utils.checkpoint`` (non-reentrant and reentrant). What fsdp_lite adds:
keyword and non-tensor arguments and nested outputs in both variants, state-dict keys
without a wrapper prefix, optional CPU offload of the saved inputs, and a policy-driven
``apply_activation_checkpointing``.

[Note: recompute inside a unit]
``FSDPModule(checkpoint_wrapper(block))``: the unit re-gathers its full parameters in its
pre-backward hook, before backward reaches the checkpointed region; the recompute then
reads the same full buffer through the views the forward installed.
``checkpoint_wrapper(FSDPModule(block))``: the recompute calls the unit's forward during
backward; the unit treats that as its pre-backward (gather once, no second set of hooks,
no extra reduce-scatter) -- see ``FSDPModule.forward``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from fsdp_lite.core import devices
from fsdp_lite.core.tree import named_as_unwrapped

if TYPE_CHECKING:
    from fsdp_lite.build.wrap import Policy

_PREFIX = "checkpointed."


class CheckpointWrapper(nn.Module):
    """Recompute ``checkpointed``'s forward in backward instead of keeping its activations."""

    _fsdp_lite_inner = "checkpointed"  # tree.WRAPPED_ATTR: unwrap steps over this wrapper

    def __init__(
        self,
        module: nn.Module,
        *,
        use_reentrant: bool = False,
        preserve_rng_state: bool = True,
        offload_to_cpu: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(module, CheckpointWrapper):
            raise ValueError("module is already wrapped by checkpoint_wrapper")
        self.checkpointed = module
        self.use_reentrant = use_reentrant
        self.preserve_rng_state = preserve_rng_state
        self.offload_to_cpu = offload_to_cpu
        # Keys as if the wrapper were not there, for saving and for loading.
        self._register_state_dict_hook(_strip_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix, with_module=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing would be saved: run plainly
            return self.checkpointed(*args, **kwargs)
        with self._saved_tensor_home(args, kwargs):
            if self.use_reentrant:
                return self._reentrant(args, kwargs)
            return checkpoint(
                self.checkpointed,
                *args,
                use_reentrant=False,
                preserve_rng_state=self.preserve_rng_state,
                **kwargs,
            )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["checkpointed"], name)

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        """Under the unwrapped model's names, as ``state_dict()`` keys (so
        ``named_parameters()`` too)."""
        yield from named_as_unwrapped(self, self.checkpointed, memo, prefix, remove_duplicate)

    def _saved_tensor_home(self, args: tuple, kwargs: dict) -> contextlib.AbstractContextManager:
        """With offload_to_cpu, the region's saved inputs wait for backward in CPU memory:
        pinned (asynchronous copies) where they come from a device that pins host memory."""
        if not self.offload_to_cpu:
            return contextlib.nullcontext()
        leaves = tree_flatten((args, kwargs))[0]
        device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), None)
        pin = device is not None and devices.pins_host_memory(device)
        return torch.autograd.graph.save_on_cpu(pin_memory=pin)

    def _reentrant(self, args: tuple, kwargs: dict) -> Any:
        """The reentrant variant takes positional tensors and returns tensors: flatten
        arguments and outputs so keyword, non-tensor and nested values pass through."""
        leaves, in_spec = tree_flatten((args, kwargs))
        is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        constants = [None if t else x for x, t in zip(leaves, is_tensor, strict=True)]
        out_box: dict[str, Any] = {}

        def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            it = iter(tensors)
            full = [next(it) if t else c for t, c in zip(is_tensor, constants, strict=True)]
            a, kw = tree_unflatten(full, in_spec)
            out_leaves, out_spec = tree_flatten(self.checkpointed(*a, **kw))
            out_box["spec"] = out_spec
            out_box["leaves"] = out_leaves
            return tuple(x for x in out_leaves if isinstance(x, torch.Tensor))

        tensors = [x for x, t in zip(leaves, is_tensor, strict=True) if t]
        outs = checkpoint(
            run, *tensors, use_reentrant=True, preserve_rng_state=self.preserve_rng_state
        )
        outs = outs if isinstance(outs, tuple) else (outs,)
        it = iter(outs)
        leaves_out = [next(it) if isinstance(x, torch.Tensor) else x for x in out_box["leaves"]]
        return tree_unflatten(leaves_out, out_box["spec"])


def _strip_prefix(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> dict:
    for key in list(state_dict):
        if key.startswith(prefix + _PREFIX):
            state_dict[prefix + key[len(prefix) + len(_PREFIX) :]] = state_dict.pop(key)
    return state_dict


def _add_prefix(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    for key in list(state_dict):
        if key.startswith(prefix) and not key.startswith(prefix + _PREFIX):
            state_dict[prefix + _PREFIX + key[len(prefix) :]] = state_dict.pop(key)


def checkpoint_wrapper(
    module: nn.Module,
    *,
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
    offload_to_cpu: bool = False,
) -> CheckpointWrapper:
    """Wrap ``module`` so its activations are recomputed in backward instead of stored.

    Args:
        use_reentrant: use ``torch.utils.checkpoint``'s reentrant variant (needs at least
            one input that requires grad; prefer the default).
        preserve_rng_state: replay the forward's CPU and CUDA RNG state in the recompute,
            so dropout masks match.
        offload_to_cpu: keep the region's saved inputs in CPU memory (pinned on CUDA)
            until backward.

    Works outside or inside an ``FSDPModule``; state-dict keys are unchanged.
    """
    return CheckpointWrapper(
        module,
        use_reentrant=use_reentrant,
        preserve_rng_state=preserve_rng_state,
        offload_to_cpu=offload_to_cpu,
    )


def apply_activation_checkpointing(
    model: nn.Module,
    policy: Policy,
    wrapper: Callable[[nn.Module], nn.Module] = checkpoint_wrapper,
) -> nn.Module:
    """Wrap in place every submodule of ``model`` that ``policy`` picks (outermost first;
    a picked module's descendants are not wrapped again). Returns ``model``."""

    made: dict[int, nn.Module] = {}  # a module registered twice gets one wrapper

    def visit(module: nn.Module) -> None:
        for name, child in list(module._modules.items()):
            if child is None or isinstance(child, CheckpointWrapper):
                continue
            if id(child) in made:
                setattr(module, name, made[id(child)])
            elif policy(child):
                made[id(child)] = wrapper(child)
                setattr(module, name, made[id(child)])
            else:
                visit(child)

    visit(model)
    return model


def make_viewless_tensor(t: torch.Tensor, requires_grad: bool, keep_graph: bool) -> torch.Tensor:
    """The same data as ``t`` without a ``._base`` reference (Megatron's utility).

    A view keeps its base tensor object, and everything autograd hangs on it, alive;
    the viewless tensor shares only the storage, so the base can be released. With
    ``keep_graph`` the result stays connected to ``t``'s autograd graph.
    """
    if t._base is None:
        return t
    if keep_graph:
        return _MakeViewless.apply(t, requires_grad)
    return _viewless(t, requires_grad)


def _viewless(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    out = torch.empty((1,), dtype=t.dtype, device=t.device, requires_grad=requires_grad)
    out.data = t.data
    return out


class _MakeViewless(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        return _viewless(t, requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
