"""Gradient norms over every shard of every rank (for clip_grad_norm_)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fsdp_lite.core import collectives

if TYPE_CHECKING:
    from fsdp_lite.core.unit import Unit


def total_norm(
    grads: list[torch.Tensor],
    p: float,
    device: torch.device,
    group: collectives.ProcessGroup,
    whole: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """The ``p``-norm of ``grads`` over every rank's shards (an all-reduce) and of ``whole``
    (gradients equal on every rank, counted once: ignored parameters'): one multi-tensor
    norm over this rank's shard grads (fp32), combined in fp32."""
    total = _local(grads, p, device)
    collectives.all_reduce(total, group, op="max" if p == float("inf") else "sum")
    if whole:
        total = torch.stack([total, _local(list(whole), p, device)])
        total = total.max() if p == float("inf") else total.sum()
    return total if p == float("inf") else total ** (1.0 / p)


def _local(grads: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """max |g| (p = inf) or sum |g|^p over ``grads``, an fp32 scalar on ``device``."""
    if grads:
        norms = torch._foreach_norm(grads, p)
        local = torch.stack([n.to(device, torch.float32) for n in norms])
    else:
        local = torch.zeros(1, dtype=torch.float32, device=device)
    return local.max() if p == float("inf") else local.pow(p).sum()


def nonfinite_units(
    units: list[Unit], device: torch.device, group: collectives.ProcessGroup
) -> list[str]:
    """Names of the units with a non-finite grad on any rank (collective)."""
    flags = torch.tensor(
        [
            any(not bool(torch.isfinite(g).all()) for f in u.flat_params for g in f.grads())
            for u in units
        ],
        dtype=torch.float32,
        device=device,
    )
    collectives.all_reduce(flags, group, op="max")
    return [u.name for u, bad in zip(units, flags.tolist(), strict=True) if bad]
