"""An fp16 gradient reduction divides part before the sum and part after (W=3: by 2, then
by 1.5), as PyTorch FSDP does, so small gradients do not underflow before they are summed
(dividing all of W first rounds a gradient of 2 subnormal units to 1 per rank, 50% high)
and the sum overflows no sooner than one gradient times sqrt(W). Checked against a
reference that rounds where fsdp_lite does: fp16(g / 2) per rank, an fp16 sum, / 1.5."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import fsdp_lite
from fsdp_lite.core import reduce
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import run_distributed

TINY = 2**-24  # fp16's smallest subnormal


def _rank_grad(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s full fp16 gradient: subnormal multiples, and values of ordinary size."""
    g = torch.Generator().manual_seed(rank)
    small = torch.randint(1, 4, (numel,), generator=g) * 2 * TINY  # 2, 4 or 6 units
    ordinary = torch.randn(numel, generator=g) * 100
    return torch.where(torch.arange(numel) % 2 == 0, small, ordinary).to(torch.float16)


def _reference(world: int, numel: int) -> torch.Tensor:
    total = torch.zeros(numel, dtype=torch.float16)
    for r in range(world):
        total += _rank_grad(r, numel) / 2
    return (total / (world / 2)).float()


def _fp16_reduce_splits_the_division(rank: int, world: int) -> None:
    mp = fsdp_lite.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)
    model = fsdp_lite.FSDPModule(nn.Linear(8, 8), mixed_precision=mp)
    model(torch.ones(1, 8, dtype=torch.float16)).sum().backward()  # allocates full buffers
    model.zero_grad(set_to_none=True)
    (flat,) = units_of(model)[0].flat_params
    flat.unshard()
    flat.full.grad = _rank_grad(rank, flat.padded_numel)
    pending = reduce.reduce_scatter(flat, torch.float16)
    pending.finish()
    want = _reference(world, flat.padded_numel).chunk(world)[rank]
    got = flat.shard.grad
    small = torch.arange(flat.padded_numel).chunk(world)[rank] % 2 == 0
    assert torch.equal(got[small], want[small]), (got[small], want[small])  # exact
    # Ordinary values: the sum's order is the backend's (gloo's ring), so the bound is
    # fp16 summation's, a few ulps of the summands' magnitude, not of the (cancelling) sum.
    magnitude = sum(_rank_grad(r, flat.padded_numel).float().abs() for r in range(world))
    bound = 4 * torch.finfo(torch.float16).eps * magnitude.chunk(world)[rank] / world
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    dist.barrier()


def test_fp16_reduce_splits_the_division_at_w3() -> None:
    run_distributed(_fp16_reduce_splits_the_division, 3, timeout=60)
