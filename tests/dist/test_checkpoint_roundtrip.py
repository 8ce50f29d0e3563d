"""Sharded checkpoints round-trip exactly at W=3 (uneven shards) for nested units, tied
weights (within and across units), frozen parameters, buffers, mixed precision, a
0-dim parameter, and CPU and SSD offload; the files read back with plain DCP into the
unwrapped model's keys."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from cases import (
    cross_tied_gpt,
    frozen_gpt,
    gpt,
    image_batch,
    token_batch,
    wrap_blocks,
    wrap_stages,
)
from ckpt_cases import assert_optim_states, assert_state_dicts
from torch import nn

import fsdp_lite
from fsdp_lite import MixedPrecision
from fsdp_lite.addons.state_dict import boxes
from fsdp_lite.testing import ConvNet, run_distributed


class Scaled(nn.Module):
    """A 0-dim parameter (owned by one rank's shard) and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 7)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("calls", torch.tensor(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.scale


def _loss(model, kind: str, rank: int, world: int) -> torch.Tensor:
    if kind == "gpt":
        x, y = (t.chunk(world)[rank] for t in token_batch(world, 0))
        return model(x, y)[1]
    if kind == "conv":
        x, y = (t.chunk(world)[rank] for t in image_batch(world, 0))
        return F.cross_entropy(model(x), y)
    return model(torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))).square().mean()


CASES = {
    "nested, tied": ("gpt", gpt, wrap_blocks),
    "tied across units": ("gpt", cross_tied_gpt, wrap_blocks),
    "frozen": ("gpt", frozen_gpt, wrap_blocks),
    "bf16": ("gpt", gpt, lambda m: wrap_blocks(m, mixed_precision=MixedPrecision(torch.bfloat16))),
    "buffers": ("conv", ConvNet, wrap_stages),
    "0-dim": ("scaled", Scaled, fsdp_lite.FSDPModule),
}


def _roundtrip(rank: int, world: int, tmp: str) -> None:
    for name, (kind, make, wrap) in CASES.items():
        torch.manual_seed(0)
        plain = make()
        model = wrap(copy.deepcopy(plain))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _loss(model, kind, rank, world).backward()
        opt.step()
        path = f"{tmp}/{name}"
        fsdp_lite.save_checkpoint(path, model, opt, extra={"case": name})
        want_sd = [model.state_dict()]  # buffers (BatchNorm statistics) as rank 0 has them
        dist.broadcast_object_list(want_sd)
        want_sd = want_sd[0]
        want_osd = fsdp_lite.full_optim_state_dict(model, opt, rank0_only=False)
        torch.manual_seed(rank + 1)
        fresh = wrap(make())
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        assert fsdp_lite.load_checkpoint(path, fresh, fresh_opt) == {"case": name}
        assert_state_dicts(fresh.state_dict(), want_sd, what=name)
        assert all(v.dtype == plain.state_dict()[k].dtype for k, v in want_sd.items()), name
        got_osd = fsdp_lite.full_optim_state_dict(fresh, fresh_opt, rank0_only=False)
        assert_optim_states(got_osd, want_osd)
        if rank == 0:
            _read_without_fsdp_lite(path, make(), want_sd, want_osd)
    _offload_roundtrip(rank, world, tmp)


def _offload_roundtrip(rank: int, world: int, tmp: str) -> None:
    """Shards on CPU (compute device CPU too) or in memory-mapped files with the AdamW
    moments: the state dict, checkpoint and optimizer state work, and loading into a
    running optimizer keeps its moments where the offload put them."""
    for name, offload in (("cpu", fsdp_lite.CPUOffload()), ("ssd", fsdp_lite.SSDOffload(tmp))):
        models, opts = [], []
        for seed in (0, rank + 1):
            torch.manual_seed(seed)
            plain = gpt()
            models.append(wrap_blocks(plain, offload=offload))
            opts.append(torch.optim.AdamW(models[-1].parameters(), lr=1e-2))
            fsdp_lite.offload_optimizer_state(opts[-1], models[-1])
            _loss(models[-1], "gpt", rank, world).backward()
            opts[-1].step()
        (model, fresh), (opt, fresh_opt) = models, opts
        path = f"{tmp}/offload_{name}"
        fsdp_lite.save_checkpoint(path, model, opt)
        moments = [s["exp_avg"].data_ptr() for s in fresh_opt.state.values()]
        fsdp_lite.load_checkpoint(path, fresh, fresh_opt)
        assert [s["exp_avg"].data_ptr() for s in fresh_opt.state.values()] == moments, name
        assert_state_dicts(fresh.state_dict(), model.state_dict(), what=f"{name} offload")
        got = fsdp_lite.full_optim_state_dict(fresh, fresh_opt, rank0_only=False)
        assert_optim_states(got, fsdp_lite.full_optim_state_dict(model, opt, rank0_only=False))


def _read_without_fsdp_lite(path: str, plain: nn.Module, want_sd: dict, want_osd: dict) -> None:
    """Plain DCP, one process, the unwrapped model's keys: what a user without us sees."""
    sd = {f"model.{k}": torch.empty_like(v) for k, v in plain.state_dict().items()}
    name = next(iter(want_osd["state"]))
    exp_avg = torch.empty_like(want_osd["state"][name]["exp_avg"])
    sd[f"optim.state.{name}.exp_avg"] = exp_avg
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    assert_state_dicts(
        {k.removeprefix("model."): sd[k] for k in sd if k.startswith("model.")}, want_sd
    )
    torch.testing.assert_close(exp_avg, want_osd["state"][name]["exp_avg"], rtol=0, atol=0)


@pytest.mark.parametrize("world", [3])
def test_sharded_checkpoint_roundtrip(world: int, tmp_path) -> None:
    run_distributed(_roundtrip, world, str(tmp_path))


def test_boxes_cover_a_flat_range_exactly() -> None:
    """Every contiguous range of every shape: disjoint boxes, each contiguous in memory,
    together exactly the range, at most 2N-1 of them (no spawn: pure geometry)."""
    g = torch.Generator().manual_seed(0)
    for shape in [(7,), (3, 4), (2, 3, 5), (4, 1, 3, 2), (1, 6)]:
        numel = math.prod(shape)
        index = torch.arange(numel).view(shape)
        for _ in range(60):
            lo, hi = sorted(torch.randint(0, numel + 1, (2,), generator=g).tolist())
            covered = []
            found = boxes(shape, lo, hi)
            assert len(found) <= max(1, 2 * len(shape) - 1), (shape, lo, hi, found)
            for offsets, sizes, first in found:
                box = index[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]
                flat = box.reshape(-1).tolist()
                assert flat == list(range(first, first + len(flat))), (shape, offsets, sizes)
                covered += flat
            assert sorted(covered) == list(range(lo, hi)), (shape, lo, hi, found)


def _hybrid(rank: int, world: int, tmp: str) -> None:
    """W=4 as 2 replicas x 2 shards: 'rank 0' is global rank 0 for rank0_only paths; a
    checkpoint writes each box once and loads into plain W=4 sharding."""
    groups = fsdp_lite.hybrid_groups(2)
    torch.manual_seed(0)
    plain = gpt()
    model = wrap_blocks(copy.deepcopy(plain), process_group=groups)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(model, "gpt", rank, world).backward()
    opt.step()
    want_sd = model.state_dict()
    want_osd = fsdp_lite.full_optim_state_dict(model, opt, rank0_only=False)
    got = model.state_dict(rank0_only=True)
    assert (got == {}) == (rank != 0), rank
    got_osd = fsdp_lite.full_optim_state_dict(model, opt)
    assert (got_osd == {}) == (rank != 0), rank
    fsdp_lite.save_checkpoint(f"{tmp}/hybrid", model, opt, extra={"rank": rank})
    for fresh_groups in (groups, None):  # hybrid again, and plain sharding over all 4
        torch.manual_seed(rank + 1)
        fresh = wrap_blocks(gpt(), process_group=fresh_groups)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        assert fsdp_lite.load_checkpoint(f"{tmp}/hybrid", fresh, fresh_opt) == {"rank": rank}
        assert_state_dicts(fresh.state_dict(), want_sd, what=f"hybrid -> {fresh_groups}")
        got = fsdp_lite.full_optim_state_dict(fresh, fresh_opt, rank0_only=False)
        assert_optim_states(got, want_osd)
    torch.manual_seed(rank + 1)
    fresh = wrap_blocks(gpt(), process_group=groups)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh.load_state_dict(want_sd if rank == 0 else {}, rank0_only=True)
    fsdp_lite.load_full_optim_state_dict(fresh, fresh_opt, got_osd, rank0_only=True)
    assert_state_dicts(fresh.state_dict(), want_sd, what="rank0_only into hybrid")
    assert_optim_states(fsdp_lite.full_optim_state_dict(fresh, fresh_opt, False), want_osd)


def test_hybrid_sharding_checkpoint_and_rank0_only(tmp_path) -> None:
    run_distributed(_hybrid, 4, str(tmp_path), timeout=600)
