"""gloo's reduce-scatter and all-gather as direct exchanges (fsdp_lite/exchange.py), at W=3:

- what the process group's own collectives give (the gather bit for bit, the sum
  up to a rounding) (fp32 and bf16; an all-gather
  and a reduce-scatter in flight together, waited for in the opposite order; waited for
  with a timeout, as collectives.py does);
- wrong sizes refused before any message is sent;
- training through the process group's own collectives (the path NCCL and W > 8 take)
  still matches the single-process reference.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from cases import gpt_run

from fsdp_lite import exchange
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import compare_training


def _tensors(rank: int, world: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    full = torch.randn(world * 1000, generator=g).to(dtype)
    shard = torch.randn(1000, generator=g).to(dtype)
    return full, shard


def _same_as_process_group(rank: int, world: int) -> None:
    group = dist.group.WORLD
    assert exchange.applies(group, torch.empty(1))
    for dtype in (torch.float32, torch.bfloat16):
        full, shard = _tensors(rank, world, dtype)
        want_rs, want_ag = torch.empty(1000, dtype=dtype), torch.empty(world * 1000, dtype=dtype)
        dist.reduce_scatter_tensor(want_rs, full.clone())
        dist.all_gather_into_tensor(want_ag, shard)
        got_rs, got_ag = torch.empty_like(want_rs), torch.empty_like(want_ag)
        gather = exchange.all_gather(got_ag, shard, group)
        scatter = exchange.reduce_scatter(got_rs, full, group)
        scatter.wait(datetime.timedelta(seconds=5))
        gather.wait()
        assert torch.equal(got_ag, want_ag), dtype
        # The sum order is this rank's chunk, then the others in rank order; gloo's
        # all-reduce sums in its own order: equal up to a rounding.
        atol = 1e-6 if dtype == torch.float32 else 0.04
        torch.testing.assert_close(got_rs, want_rs, rtol=0, atol=atol)


def _refused_before_sending(rank: int, world: int) -> None:
    group = dist.group.WORLD
    with pytest.raises(ValueError, match="reduce_scatter"):
        exchange.reduce_scatter(torch.empty(3), torch.ones(world * 2), group)
    with pytest.raises(ValueError, match="all_gather"):
        exchange.all_gather(torch.empty(world * 2 + 1), torch.ones(2), group)
    dist.barrier()  # nothing left half-sent: the group still works


def _cases(rank: int, world: int) -> dict:
    _same_as_process_group(rank, world)
    _refused_before_sending(rank, world)
    saved = exchange.MAX_RANKS
    exchange.MAX_RANKS = 1  # the process group's own collectives
    try:
        run = gpt_run("process group collectives", world)
        compare_training(run)
        run_bf16 = gpt_run("process group collectives", world, "bf16")
        compare_training(run_bf16)
    finally:
        exchange.MAX_RANKS = saved
    return {run.name: run.results, run_bf16.name: run_bf16.results}


def test_exchange_matches_process_group_collectives() -> None:
    print(run_distributed(_cases, 3)[0])
