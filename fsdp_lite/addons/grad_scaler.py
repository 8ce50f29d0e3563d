"""fp16 loss scaling for sharded gradients: every rank skips the same steps.

[Note: one overflow verdict for all ranks]
``torch.amp.GradScaler`` checks the gradients its optimizer holds for inf/nan and skips
the step (and halves its scale) if it finds any. Under fsdp_lite a rank's optimizer holds
only that rank's 1/W shard grads, so an overflow that lands in one rank's shard is seen by
that rank alone: it skips the step and backs off its scale while its peers step and keep
theirs, and from then on the ranks train with different scales and different weights.
``ShardedGradScaler`` all-reduces the found-inf flags (MAX over the process group) right
after the unscale, so every rank skips the same steps and updates its scale identically.

Each optimizer it unscales is marked, so the optimizer misuse check
(``core/optimizer_check.py``) warns at the first step of an optimizer over fp16 shards of
a multi-rank unit that no ``ShardedGradScaler`` unscaled (a stock one, or none).
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_lite.core import collectives, devices
from fsdp_lite.core.optimizer_check import mark_overflow_agreed


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

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # fp16 shard grads are legitimate here: pure fp16 (FSDPModule(fp32_masters=False)
        # over a .half() model), as FSDP1's ShardedGradScaler allows.
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

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
        mark_overflow_agreed(optimizer)
