"""fp16 loss scaling for sharded gradients: every rank skips the same steps.

[Note: one overflow verdict for all ranks]
``torch.amp.GradScaler`` checks the gradients its optimizer holds for inf/nan and skips
the step (and halves its scale) if it finds any. Under fsdp_lite a rank's optimizer holds
only that rank's 1/W shard grads, so an overflow that lands in one rank's shard is seen by
that rank alone: it skips the step and backs off its scale while its peers step and keep
theirs, and from then on the ranks train with different scales and different weights.
``ShardedGradScaler`` all-reduces the found-inf flags (MAX over the process group) right
after the unscale, so every rank skips the same steps and updates its scale identically.

Stepping fsdp_lite shards of a multi-rank unit from a stock ``GradScaler`` warns once per
optimizer (``install_stock_scaler_check``, installed by the first ``FSDPModule``).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_lite.core import collectives, devices
from fsdp_lite.core.flat_param import shard_ranks


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for fsdp_lite shards: same methods, same state dict, and
    one overflow verdict shared by every rank of ``process_group``.

    Use it exactly like ``GradScaler``::

        scaler = fsdp_lite.ShardedGradScaler()   # on the ranks' device, as FSDPModule
        scaler.scale(loss).backward()
        scaler.unscale_(opt)                # optional, e.g. before model.clip_grad_norm_
        scaler.step(opt)                    # skipped on every rank if any rank overflowed
        scaler.update()

    ``unscale_`` (which ``step`` calls when you did not) all-reduces this rank's found-inf
    flags over ``process_group`` (one float, no host sync), so every rank of the group must
    call it for the same optimizers in the same order, as it calls backward.

    Args:
        device: ``"cuda"`` or ``"cpu"``; default: the type of the device ``FSDPModule``
            picks by default (CUDA where available, else CPU).
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as for
            ``torch.amp.GradScaler``.
        process_group: the ranks that must agree (default: the world group). Use the group
            your units shard over (the world group under hybrid sharding).
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: collectives.ProcessGroup | None = None,
    ) -> None:
        if device is None:  # torch's GradScaler says "cuda", and is disabled without it
            device = devices.default_device(None).type
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group  # None: the world group, resolved at first use

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's grads in place and agree with every rank on overflow."""
        super().unscale_(optimizer)
        if self._enabled:
            self._agree_on_overflow(optimizer)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # The check step() runs instead of unscale_ for optimizers that unscale themselves
        # (_step_supports_amp_scaling, e.g. fused Adam).
        found = super()._check_inf_per_device(optimizer)
        self._agree_on_overflow(optimizer)
        return found

    def _agree_on_overflow(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer``'s found-inf flags say, on every rank, whether any rank of the
        group found an inf/nan.

        The flags (one per device holding grads: CPU under CPU offload, the scale's device
        otherwise) are combined on the collective's device and all-reduced (MAX); the result
        becomes the flag of that device and the other flags are zeroed. One flag carries
        the verdict because ``step`` (for fused optimizers) and ``update`` sum the flags,
        and a fused optimizer skips only when that sum is exactly 1. No host sync of ours (a
        CUDA flag is read by a CPU collective only if the scaler is on CPU). A rank with no
        grads gets a flag as well, so its step and update follow its peers.
        """
        collectives.require_initialized("fsdp_lite.ShardedGradScaler")
        group = collectives.resolve_group(self.process_group)
        scale, _ = self._check_scale_growth_tracker("unscale_")
        # Where the group's backend takes the flags (NCCL: CUDA tensors only).
        device = collectives.comm_device(group, scale.device)
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        verdict = torch.zeros((), dtype=torch.float32, device=device)  # shape: ()
        non_blocking = devices.pins_host_memory(device)
        for flag in flags.values():  # each 0.0 or 1.0; the verdict too (fused kernels test == 1)
            torch.maximum(verdict, flag.to(device, non_blocking=non_blocking), out=verdict)
        collectives.all_reduce(verdict, group, op="max", kind="grad_scaler")
        for flag in flags.values():
            flag.zero_()
        flags[device] = verdict


# -- the check for a stock GradScaler -----------------------------------------------
# optimizer -> (its number of param groups when last looked at, "skip" | "watch" | "warned")
_SEEN: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, str]] = (
    weakref.WeakKeyDictionary()
)
_HOOK: list[Any] = []  # the global step pre-hook's handle, once installed
_FRAMES_UP = 8  # the scaler's step is 2-4 frames above the hook; a little slack


def install_stock_scaler_check() -> None:
    """Warn once per optimizer when a stock ``torch.amp.GradScaler`` steps fsdp_lite shards
    of a multi-rank unit (a global optimizer step pre-hook; installing twice is a no-op)."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_step))


def _check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    groups = len(optimizer.param_groups)
    seen = _SEEN.get(optimizer)
    if seen is None or (seen[0] != groups and seen[1] != "warned"):
        seen = (groups, "watch" if _holds_multi_rank_shards(optimizer) else "skip")
        _SEEN[optimizer] = seen
    if seen[1] != "watch":
        return
    user_level = _stock_scaler_caller()
    if user_level is None:
        return
    _SEEN[optimizer] = (groups, "warned")
    warnings.warn(
        f"fsdp_lite: a stock torch.amp.GradScaler steps {type(optimizer).__name__} over "
        "fsdp_lite shards of a multi-rank unit. Each rank's scaler checks only its own "
        "shard grads for inf/nan, so the ranks skip different steps and their loss scales "
        "(and weights) drift apart. Use fsdp_lite.ShardedGradScaler, a drop-in replacement "
        "whose ranks agree on every overflow.",
        UserWarning,
        stacklevel=user_level,
    )


def _holds_multi_rank_shards(optimizer: torch.optim.Optimizer) -> bool:
    return any(
        (shard_ranks(p) or (1, 1))[0] > 1 for g in optimizer.param_groups for p in g["params"]
    )


def _stock_scaler_caller() -> int | None:
    """If a stock (not sharded) GradScaler's ``step`` is on the stack: the stack level, as
    ``warnings.warn`` in ``_check_step`` counts it, of the code that called that ``step``."""
    frame = sys._getframe(2)  # past this function and _check_step (level 1)
    for level in range(2, 2 + _FRAMES_UP):
        if frame is None:
            return None
        name = frame.f_code.co_name
        if name in ("step", "_maybe_opt_step"):
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.amp.GradScaler):
                if isinstance(owner, ShardedGradScaler):
                    return None
                return level + (2 if name == "_maybe_opt_step" else 1)
        frame = frame.f_back
    return None
