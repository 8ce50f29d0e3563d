"""Policy dataclasses: small, frozen, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes a unit computes and communicates in; the fp32 shard stays the master copy.

    Args:
        param_dtype: dtype of the full (gathered) parameters and of the forward and
            backward compute. Shards are cast to it *before* the all-gather, so the
            gather moves ``param_dtype`` bytes.
        reduce_dtype: dtype of the gradient reduce-scatter. ``None`` means ``param_dtype``.
            The reduced gradient is always accumulated into the fp32 shard grad.
        buffer_dtype: dtype buffers (e.g. running statistics) compute in. ``None`` keeps
            each buffer's own dtype. State dicts always return buffers in their original dtype.
        cast_inputs: the root unit casts floating-point inputs (nested in tuples, lists,
            dicts and keyword arguments) to ``param_dtype``.
        fp32_module_types: module types that compute in fp32 whatever ``param_dtype`` is:
            their parameters are gathered in fp32, their buffers stay fp32, floating
            inputs are cast to fp32 and floating outputs back to ``param_dtype``.
            By default every BatchNorm, whose statistics drift or whose kernels are
            missing in half precision (as in PyTorch FSDP1, which keeps norms in fp32).
    """

    param_dtype: torch.dtype = torch.float16
    reduce_dtype: torch.dtype | None = torch.float32
    buffer_dtype: torch.dtype | None = None
    cast_inputs: bool = True
    fp32_module_types: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, field)
            if field != "param_dtype" and value is None:
                continue
            if value not in _LOW_PRECISION:
                raise ValueError(
                    f"MixedPrecision.{field} must be one of torch.float16, torch.bfloat16 or "
                    f"torch.float32, got {value!r}"
                )
        if not isinstance(self.fp32_module_types, tuple) or not all(
            isinstance(t, type) and issubclass(t, nn.Module) for t in self.fp32_module_types
        ):
            raise ValueError(
                "MixedPrecision.fp32_module_types must be a tuple of nn.Module subclasses, "
                f"got {self.fp32_module_types!r}"
            )

    @property
    def effective_reduce_dtype(self) -> torch.dtype:
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype


@dataclass(frozen=True)
class PrefetchPolicy:
    """Which all-gathers a unit issues ahead of time, from the order recorded on the first pass.

    Args:
        forward: when a unit starts its forward, gather the next units in forward order.
        backward: when a unit's backward starts, gather the next units in backward order
            (before this unit's reduce-scatter is issued); the root's backward, the step's
            highest point, prefetches nothing.
        max_in_flight: how many units' gathers may be in flight at once, the running
            unit's own included: 2 (the default) gathers one unit ahead, as PyTorch's FSDP
            does; 1 prefetches nothing. Bounds memory: at most ``max_in_flight`` units
            (plus enclosing units such as the root) hold full parameters at once.
    """

    forward: bool = True
    backward: bool = True
    max_in_flight: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(
                f"PrefetchPolicy.max_in_flight must be an int >= 1, got {self.max_in_flight!r}; "
                "pass prefetch=None to FSDPModule to turn prefetching off"
            )


# What an optimizer over a wrapped model steps (``FSDPModule(optimizer_params=...)``):
# "flat": one flat shard per unit and dtype (the cheapest on the host); "pieces": this
# rank's piece of each original parameter, under its name (FSDP1's use_orig_params=True);
# "whole": whole original parameters, each owned by one rank (matrix optimizers: Muon).
OPTIMIZER_PARAMS = ("flat", "pieces", "whole")


def resolve_optimizer_params(
    optimizer_params: str | None, use_orig_params: bool = False, whole_params: bool = False
) -> str:
    """The one option from the new name and the two older booleans (``use_orig_params``,
    FSDP1's name, means "pieces"; ``whole_params`` means "whole"); raises if they disagree."""
    implied = "whole" if whole_params else "pieces" if use_orig_params else None
    if optimizer_params is None:
        return implied or "flat"
    if optimizer_params not in OPTIMIZER_PARAMS:
        raise ValueError(
            f"optimizer_params must be one of {OPTIMIZER_PARAMS}, got {optimizer_params!r}"
        )
    if implied is not None and implied != optimizer_params:
        raise ValueError(
            f"optimizer_params={optimizer_params!r} contradicts use_orig_params="
            f"{use_orig_params}, whole_params={whole_params}: pass optimizer_params alone"
        )
    return optimizer_params


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the shard an optimizer steps: fp32 for a module loaded in bf16 or fp16
    (low-precision masters lose small updates to rounding), else the parameter's own."""
    return torch.float32 if dtype.itemsize < 4 else dtype


def compute_dtype(mp: MixedPrecision | None, module: nn.Module, p: torch.Tensor) -> torch.dtype:
    """The dtype ``module``'s parameter ``p`` computes in: its own unless ``mp`` says
    otherwise; fp32 (or wider) for ``mp.fp32_module_types``, whatever dtype the module was
    loaded in. Wrapping and the planner both ask it."""
    if mp is None:
        return p.dtype
    if isinstance(module, mp.fp32_module_types):
        return master_dtype(p.dtype)
    return mp.param_dtype
