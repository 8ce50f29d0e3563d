"""gloo's reduce-scatter and all-gather as direct exchanges (fsdp_lite/exchange.py), at W=3:

- what the process group's own collectives give (the gather bit for bit, the sum
  up to a rounding) (fp32 and bf16; an all-gather
  and a reduce-scatter in flight together, waited for in the opposite order; waited for
  with a timeout, as collectives.py does);
- wrong sizes refused before any message is sent;
- training through the process group's own collectives (the path NCCL and W > 8 take),
  and through TCP messages (ranks on different hosts), still matches the single-process
  reference; every other multi-rank test trains through the shared-memory rings;
- the rings (fsdp_lite/shared_ring.py): set up at a group's first exchange, nothing left
  in /dev/shm; results bit for bit those of TCP messages; a ring too small for what is
  in flight waits for room, a payload over half of it goes over TCP; one rank without a
  ring means no ring for anyone in that group; a group destroyed and made again under
  the same name starts afresh, and an exchange stranded on the old one gives up.
"""

from __future__ import annotations

import atexit
import datetime
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from cases import gpt_run

from fsdp_lite import exchange, shared_ring
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


def _ring_set_up(rank: int, world: int) -> None:
    name = dist.group.WORLD.group_name
    assert exchange._groups[name].ring is not None, "ranks on one host exchange through rings"
    mine = f"fsdp_lite-{os.getpid()}-"
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(mine)], "unlinked"


def _ring_same_as_tcp(rank: int, world: int) -> None:
    group = dist.group.WORLD
    ring = exchange._groups[group.group_name].ring
    for dtype in (torch.float32, torch.bfloat16):
        full, shard = _tensors(rank, world, dtype)
        got = {}
        for how in ("ring", "tcp"):
            exchange._groups[group.group_name].ring = ring if how == "ring" else None
            rs, ag = torch.empty(1000, dtype=dtype), torch.empty(world * 1000, dtype=dtype)
            exchange.reduce_scatter(rs, full, group).wait()
            exchange.all_gather(ag, shard, group).wait()
            got[how] = rs, ag
        exchange._groups[group.group_name].ring = ring
        assert all(torch.equal(a, b) for a, b in zip(got["ring"], got["tcp"], strict=True)), dtype


def _small_ring(rank: int, world: int) -> None:
    """Six gathers and two reduce-scatters in flight in an 8 KiB ring (4 KiB payloads at
    most): staging waits for peers to take earlier regions whenever they have not yet (the
    waiting itself is tested in tests/unit/test_shared_ring.py); an 8 KB shard goes over TCP."""
    saved, shared_ring.RING_BYTES = shared_ring.RING_BYTES, 8192
    try:
        group = dist.new_group(list(range(world)))
        inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(rank * 10 + i))
                  for i in range(6)] + [torch.randn(2000)]  # fmt: skip
        fulls = [torch.randn(world * 500) for _ in range(2)]
        outs = [torch.empty(world * t.numel()) for t in inputs]
        sums = [torch.empty(500) for _ in fulls]
        works = [exchange.all_gather(o, t, group) for o, t in zip(outs, inputs, strict=True)]
        works += [exchange.reduce_scatter(o, f, group) for o, f in zip(sums, fulls, strict=True)]
        assert exchange._groups[group.group_name].ring.capacity == 8192
        for work in works:
            work.wait()
        for out, t in zip(outs, inputs, strict=True):
            want = torch.empty_like(out)
            dist.all_gather_into_tensor(want, t, group=group)
            assert torch.equal(out, want)
        for out, f in zip(sums, fulls, strict=True):
            want = torch.empty_like(out)
            dist.reduce_scatter_tensor(want, f.clone(), group=group)
            torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    finally:
        shared_ring.RING_BYTES = saved


def _no_ring_unless_everyone(rank: int, world: int) -> None:
    saved = shared_ring.RING_BYTES
    shared_ring.RING_BYTES = 0 if rank == world - 1 else saved
    try:
        group = dist.new_group(list(range(world)))
        full, shard = _tensors(rank, world, torch.float32)
        ag = torch.empty(world * 1000)
        exchange.all_gather(ag, shard, group).wait()
        assert exchange._groups[group.group_name].ring is None
        want = torch.empty_like(ag)
        dist.all_gather_into_tensor(want, shard, group=group)
        assert torch.equal(ag, want)
    finally:
        shared_ring.RING_BYTES = saved


def _cases(rank: int, world: int) -> dict:
    _same_as_process_group(rank, world)
    _refused_before_sending(rank, world)
    _ring_set_up(rank, world)
    _ring_same_as_tcp(rank, world)
    _small_ring(rank, world)
    _no_ring_unless_everyone(rank, world)
    name = dist.group.WORLD.group_name
    ring, exchange._groups[name].ring = exchange._groups[name].ring, None  # TCP messages
    try:
        tcp = gpt_run("TCP exchanges", world)
        compare_training(tcp)
    finally:
        exchange._groups[name].ring = ring
    saved = exchange.MAX_RANKS
    exchange.MAX_RANKS = 1  # the process group's own collectives
    try:
        run = gpt_run("process group collectives", world)
        compare_training(run)
        run_bf16 = gpt_run("process group collectives", world, "bf16")
        compare_training(run_bf16)
    finally:
        exchange.MAX_RANKS = saved
    _group_made_again(rank, world)  # last: it replaces the default group
    return {run.name: run.results, run_bf16.name: run_bf16.results, tcp.name: tcp.results}


def _group_made_again(rank: int, world: int) -> None:
    """The default group destroyed and made again (same name, "0") after rank 0 issued a
    gather no peer joined: the new group starts afresh on every rank (no stale counts
    pairing different exchanges), and rank 0's stranded gather gives up instead of holding
    up the exchanges queued behind it."""
    where = [tempfile.mkdtemp(prefix="fsdp_lite_reinit_") if rank == 0 else None]
    if rank == 0:
        atexit.register(shutil.rmtree, where[0], True)  # once the new group is gone too
    dist.broadcast_object_list(where, src=0)
    old = dist.group.WORLD
    stranded = None
    if rank == 0:
        stranded = exchange.all_gather(torch.empty(world * 10), torch.ones(10), old)
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", init_method=f"file://{where[0]}/again", rank=rank, world_size=world
    )
    group = dist.group.WORLD
    assert group.group_name == old.group_name and group is not old
    _, shard = _tensors(rank, world, torch.float32)
    got, want = torch.empty(world * 1000), torch.empty(world * 1000)
    exchange.all_gather(got, shard, group).wait()
    dist.all_gather_into_tensor(want, shard, group=group)
    assert torch.equal(got, want)
    assert exchange._groups[group.group_name].ring is not None
    if stranded is not None:
        with pytest.raises(RuntimeError, match="an earlier exchange failed") as err:
            stranded.wait()
        assert "was destroyed" in str(err.value.__cause__)


def test_exchange_matches_process_group_collectives() -> None:
    print(run_distributed(_cases, 3)[0])
