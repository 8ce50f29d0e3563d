"""Saves are atomic: a save killed with SIGKILL -- while ranks write, or between the
renames that publish it -- leaves the previous checkpoint loadable, and training
resumed from it matches the single-process reference. Loading a partial, truncated,
foreign (another model's) or mismatched checkpoint raises CheckpointError on every rank,
loading nothing.

The killed runs are subprocesses (2 ranks each) that block at the chosen point and
signal the test, which kills their whole process group.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from cases import gpt, wrap_stages
from ckpt_cases import (
    assert_optim_states,
    assert_state_dicts,
    fsdp_optimizer,
    global_batch,
    local_batch,
    plain_optim_state,
    reference_optimizer,
    train_step,
    wrap_blocks_and_norms,
)

import fsdp_lite
from fsdp_lite import CheckpointError
from fsdp_lite.testing import ConvNet, run_distributed

KILL_POINTS = ("write", "rename")


# -- the run that gets killed (a subprocess) ------------------------------------------


def _block_at(point: str, rank: int, marker: str) -> None:
    """Make the next save stop for good at ``point`` once it got there, and say so."""

    def arrived() -> None:
        open(marker, "w").close()
        time.sleep(600)

    if point == "write" and rank == 1:  # rank 1 wrote its data; rank 0 waits for it
        original = dcp.FileSystemWriter.write_data

        def write_data(self, plan, planner):
            future = original(self, plan, planner)
            future.wait()
            arrived()

        dcp.FileSystemWriter.write_data = write_data
    if point == "rename" and rank == 0:  # the previous checkpoint was just moved aside
        original_rename = os.rename

        def rename(src, dst):
            original_rename(src, dst)
            if str(dst).endswith(".old"):
                arrived()

        os.rename = rename


def _killed_run(rank: int, world: int, path: str, point: str, marker: str) -> None:
    torch.manual_seed(0)
    model = wrap_blocks_and_norms(gpt())
    opt = fsdp_optimizer(model)
    train_step(model, opt, local_batch(0, rank, world))
    fsdp_lite.save_checkpoint(path, model, opt, extra={"step": 1})
    sd = model.state_dict(rank0_only=True)
    osd = fsdp_lite.full_optim_state_dict(model, opt)
    if rank == 0:
        torch.save({"sd": sd, "osd": osd}, path + ".expected")
    train_step(model, opt, local_batch(1, rank, world))
    _block_at(point, rank, marker)
    fsdp_lite.save_checkpoint(path, model, opt, extra={"step": 2})
    raise AssertionError("the save was not killed")


def _kill_mid_save(tmp: str, point: str) -> str:
    path, marker = os.path.join(tmp, f"ckpt_{point}"), os.path.join(tmp, f"{point}.reached")
    log = open(os.path.join(tmp, f"{point}.log"), "w")
    child = subprocess.Popen(
        [sys.executable, __file__, path, point, marker],
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=os.path.dirname(__file__),
    )
    deadline = time.monotonic() + 300
    while not os.path.exists(marker):
        if child.poll() is not None or time.monotonic() > deadline:
            os.killpg(child.pid, signal.SIGKILL)
            raise AssertionError(f"the save never reached '{point}': {open(log.name).read()}")
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    return path


# -- checks in fresh processes ---------------------------------------------------------


def _resumes_like_reference(rank: int, world: int, paths: dict[str, str]) -> None:
    for point, path in paths.items():
        _resume_one(rank, world, path, point)


def _resume_one(rank: int, world: int, path: str, point: str) -> None:
    want = torch.load(path + ".expected", weights_only=False)
    torch.manual_seed(rank + 9)
    model = wrap_blocks_and_norms(gpt())
    opt = fsdp_optimizer(model)
    extra = fsdp_lite.load_checkpoint(path, model, opt)
    assert extra == {"step": 1}, (point, extra)
    assert_state_dicts(model.state_dict(), want["sd"], what=f"killed at {point}")
    assert_optim_states(fsdp_lite.full_optim_state_dict(model, opt, rank0_only=False), want["osd"])
    ref = gpt()
    ref.load_state_dict(want["sd"])
    ref_opt = reference_optimizer(ref)
    ref_opt.load_state_dict(plain_optim_state(ref, ref_opt, want["osd"]))
    loss = train_step(model, opt, local_batch(1, rank, world))
    ref_loss = train_step(ref, ref_opt, global_batch(1))
    dist.all_reduce(loss)
    torch.testing.assert_close(loss.item() / world, ref_loss.item(), rtol=1e-5, atol=0)
    assert_state_dicts(model.state_dict(), ref.state_dict(), atol=1e-5, what="resumed")
    # the next save to the same path recovers the directory and publishes normally
    fsdp_lite.save_checkpoint(path, model, opt, extra={"step": 2})
    assert fsdp_lite.load_checkpoint(path, model, opt) == {"step": 2}
    dist.barrier()
    assert not os.path.exists(path + ".old") and not os.path.exists(path + ".tmp")


def _refuses(rank: int, world: int, tmp: str) -> None:
    torch.manual_seed(0)
    model = wrap_blocks_and_norms(gpt())
    opt = fsdp_optimizer(model)
    before = model.state_dict()
    good = os.path.join(tmp, "good")
    fsdp_lite.save_checkpoint(good, model, opt)
    truncated, foreign = os.path.join(tmp, "truncated"), os.path.join(tmp, "foreign")
    if rank == 0:
        shutil.copytree(good, truncated)
        with open(os.path.join(truncated, "__1_0.distcp"), "r+b") as f:
            f.truncate(100)
    dcp.save({"w": torch.zeros(3)}, checkpoint_id=foreign)
    convnet = os.path.join(tmp, "convnet")
    fsdp_lite.save_checkpoint(convnet, wrap_stages(ConvNet()))
    user_dir = os.path.join(tmp, "user_dir")
    if rank == 0:
        os.makedirs(user_dir)
        open(os.path.join(user_dir, "notes.txt"), "w").close()
    no_optim = os.path.join(tmp, "no_optim")
    fsdp_lite.save_checkpoint(no_optim, model)
    dist.barrier()
    cases = {
        os.path.join(tmp, "partial"): "not a complete checkpoint",  # left by the kill
        truncated: "is incomplete: __1_0.distcp is missing or short",
        # another program's weights-only export, of another model: every key named
        foreign: r"does not match.*missing keys: \['wte.weight'.*unexpected keys: \['w'\]",
        convnet: "does not match the model.*missing keys",
        no_optim: "holds no optimizer state",
        os.path.join(tmp, "nothing"): "no checkpoint at",
    }
    torch.manual_seed(1)
    target = wrap_blocks_and_norms(gpt())
    target_opt = fsdp_optimizer(target)
    untouched = target.state_dict()
    for path, needle in cases.items():
        with pytest.raises(CheckpointError, match=needle):
            fsdp_lite.load_checkpoint(path, target, target_opt)
    with pytest.raises(CheckpointError, match="2 param groups, this one 1"):
        fsdp_lite.load_checkpoint(good, target, torch.optim.AdamW(target.parameters()))
    assert_state_dicts(target.state_dict(), untouched, what="after refused loads")
    fsdp_lite.load_checkpoint(good, target, target_opt)
    assert_state_dicts(target.state_dict(), before, what="after a good load")
    with pytest.raises(CheckpointError, match="is not a checkpoint: refusing to replace it"):
        fsdp_lite.save_checkpoint(user_dir, model)
    assert os.listdir(user_dir) == ["notes.txt"]
    with pytest.raises(TypeError, match="extra must be a dict"):
        fsdp_lite.save_checkpoint(good, model, extra=[1])


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[str, dict[str, str]]:
    tmp = str(tmp_path_factory.mktemp("atomic"))
    paths = {point: _kill_mid_save(tmp, point) for point in KILL_POINTS}
    shutil.copytree(paths["write"] + ".tmp", os.path.join(tmp, "partial"))
    return tmp, paths


def test_killed_save_leaves_previous_checkpoint(killed) -> None:
    tmp, paths = killed
    write, rename = paths["write"], paths["rename"]
    assert os.path.exists(write) and os.path.exists(write + ".tmp")  # data, no .metadata
    assert not os.path.exists(os.path.join(write + ".tmp", ".metadata"))
    assert not os.path.exists(rename) and os.path.exists(rename + ".old")
    run_distributed(_resumes_like_reference, 2, paths)


def test_partial_or_foreign_checkpoint_is_refused(killed) -> None:
    tmp, _ = killed
    run_distributed(_refuses, 2, tmp)


if __name__ == "__main__":  # the run that gets killed
    run_distributed(_killed_run, 2, *sys.argv[1:])
