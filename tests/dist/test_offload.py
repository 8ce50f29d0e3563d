"""CPU and SSD offload: training equals the reference and is bitwise equal to no offload;
SSD files are private, resident only while used, removed afterwards; a directory that
cannot hold them fails at wrap time."""

from __future__ import annotations

import copy
import functools
import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch
from cases import gpt, gpt_run, token_batch, wrap_blocks
from test_checkpointing import unit_outside

import fsdp_lite
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import compare_training
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests


def _offloads(tmp: str) -> dict:
    return {"cpu": fsdp_lite.CPUOffload(), "ssd": fsdp_lite.SSDOffload(tmp)}


def _equivalence_runs(world: int, tmp: str) -> list:
    runs = []
    for name, offload in _offloads(tmp).items():
        for raf in (None, True, False):
            wrap = functools.partial(wrap_blocks, offload=offload, reshard_after_forward=raf)
            runs.append(gpt_run(f"{name} offload", world, raf=raf, wrap=wrap))
        wrap = functools.partial(wrap_blocks, offload=offload)
        runs.append(gpt_run(f"{name} offload no_sync", world, wrap=wrap, accumulate=2))
        runs.append(gpt_run(f"{name} offload clip", world, wrap=wrap, clip=0.05))
        mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16)
        wrap = functools.partial(wrap_blocks, offload=offload, mixed_precision=mp)
        runs.append(gpt_run(f"{name} offload", world, "bf16", wrap=wrap))
        wrap = functools.partial(unit_outside, reentrant=False, offload=offload)
        runs.append(gpt_run(f"{name} offload + checkpointing", world, wrap=wrap))
    return runs


def _train(model, steps: int, world: int, rank: int, ssd_state: bool = False) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if ssd_state:
        fsdp_lite.offload_optimizer_state(opt, model)
    losses = []
    for step in range(steps):
        x, y = (t.chunk(world)[rank] for t in token_batch(world, step))
        loss = model(x, y)[1]
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


def _resident_file_kib(directory: str) -> int:
    """Resident KiB of this process's mappings of files under ``directory``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:  # a mapping header line
                inside = len(parts) >= 6 and parts[5].startswith(directory)
            elif inside and parts[0] == "Rss:":
                total += int(parts[1])
    return total


def _bitwise_and_files(world: int, rank: int, tmp: str) -> None:
    torch.manual_seed(0)
    base = gpt()
    plain = wrap_blocks(copy.deepcopy(base))
    cpu = wrap_blocks(copy.deepcopy(base), offload=fsdp_lite.CPUOffload())
    ssd = wrap_blocks(copy.deepcopy(base), offload=fsdp_lite.SSDOffload(tmp))
    directory = Path(tmp, f"rank{rank}").resolve()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = list(directory.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    want, want_opt = _train(plain, 4, world, rank)
    for model, ssd_state in ((cpu, False), (ssd, True)):
        got, opt = _train(model, 4, world, rank, ssd_state)
        # between steps nothing offloaded is resident (before this test reads it back)
        assert _resident_file_kib(str(directory)) == 0, "offloaded pages stayed resident"
        assert got == want, (got, want)
        for k, v in plain.state_dict().items():
            assert torch.equal(model.state_dict()[k], v), k
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert p.device.type == "cpu" and p.dtype == torch.float32
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][key], want_opt.state[q][key]), key
    assert len(list(directory.iterdir())) > len(files)  # the moments moved into files
    del ssd, opt, model
    import gc

    gc.collect()
    assert not directory.exists(), "SSD offload files outlived the model"


def _offload(rank: int, world: int, tmp: str) -> dict:
    cases = [
        (run.name, functools.partial(compare_training, run))
        for run in _equivalence_runs(world, os.path.join(tmp, "eq"))
    ]
    bitwise = functools.partial(_bitwise_and_files, world, rank, os.path.join(tmp, "bitwise"))
    cases.append(("bitwise equal to no offload; files private, paged out, removed", bitwise))
    return run_subtests(cases)


@pytest.mark.parametrize("world", [1, 2])
def test_offload_matches_reference_and_no_offload(world: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        assert_subtests_passed(run_distributed(_offload, world, tmp))


def test_unusable_ssd_directory_fails_at_wrap_time(world1) -> None:
    with tempfile.NamedTemporaryFile() as not_a_dir:
        with pytest.raises(RuntimeError, match="SSDOffload cannot create its files under"):
            fsdp_lite.FSDPModule(gpt(), offload=fsdp_lite.SSDOffload(not_a_dir.name + "/x"))
