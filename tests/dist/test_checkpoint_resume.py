"""Resuming from a checkpoint gives exactly the run that was never interrupted, and
resuming at another world size continues like the single-process reference.

One W=2 run trains 6 steps straight beside a single-process reference and saves a
checkpoint after step 3. New processes then load it and train steps 4-6:
- at W=2, with dropout and the RNG state saved in ``extra``: losses, parameters and
  optimizer state equal the straight run's bit for bit;
- at W=1 and W=3 (uneven shards): losses, parameters and AdamW state match the reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from cases import gpt
from ckpt_cases import (
    assert_optim_states,
    assert_state_dicts,
    fsdp_optimizer,
    local_batch,
    mean_loss,
    named_optim_state,
    pack,
    reference_optimizer,
    unpack,
    wrap_blocks_and_norms,
)

import fsdp_lite
from fsdp_lite.testing import run_distributed

STEPS, SAVE_AT = 6, 3


def _scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


class RankStreams:
    """The reference runs every rank's slice with that rank's RNG stream, so its dropout
    masks are the ones each rank draws."""

    def __init__(self, world: int) -> None:
        self.states = [torch.manual_seed(1000 + r).get_state() for r in range(world)]

    def loss(self, model, step: int) -> torch.Tensor:
        world = len(self.states)
        mine = torch.get_rng_state()
        losses = []
        for r in range(world):
            torch.set_rng_state(self.states[r])
            losses.append(model(*local_batch(step, r, world))[1])
            self.states[r] = torch.get_rng_state()
        torch.set_rng_state(mine)
        return sum(losses) / world


def _train_and_save(rank: int, world: int, tmp: str) -> bytes:
    """Straight runs: D (dropout, RNG matters) and R (no dropout, resharded later)."""
    out = {}
    for tag, dropout in (("D", 0.1), ("R", 0.0)):
        torch.manual_seed(0)
        ref = gpt(dropout=dropout)
        model = wrap_blocks_and_norms(copy.deepcopy(ref))
        opt, ref_opt = fsdp_optimizer(model), reference_optimizer(ref)
        sched, ref_sched = _scheduler(opt), _scheduler(ref_opt)
        streams = RankStreams(world)
        torch.manual_seed(1000 + rank)  # this rank's dropout stream
        losses, ref_losses = [], []
        for step in range(STEPS):
            if step == SAVE_AT:
                extra = {"step": step, "rng": torch.get_rng_state(), "sched": sched.state_dict()}
                fsdp_lite.save_checkpoint(f"{tmp}/{tag}", model, opt, extra=extra)
            loss = model(*local_batch(step, rank, world))[1]
            loss.backward()
            opt.step(), opt.zero_grad(), sched.step()
            losses.append(loss.detach())
            ref_loss = streams.loss(ref, step)
            ref_loss.backward()
            ref_opt.step(), ref_opt.zero_grad(), ref_sched.step()
            ref_losses.append(ref_loss.item())
            torch.testing.assert_close(mean_loss(loss), ref_loss.item(), rtol=1e-5, atol=0)
        out[tag] = {
            "losses": losses,
            "sd": model.state_dict(),
            "osd": fsdp_lite.full_optim_state_dict(model, opt, rank0_only=False),
            "ref_losses": ref_losses,
            "ref_sd": ref.state_dict(),
            "ref_osd": named_optim_state(ref, ref_opt),
        }
        assert_state_dicts(out[tag]["sd"], out[tag]["ref_sd"], atol=1e-5, what=f"{tag} straight")
    return pack(out)


def _resume(rank: int, world: int, tmp: str, tag: str, straight: list[bytes]) -> bytes:
    """New processes: a differently initialized model, loaded, trains the last steps."""
    want = unpack(straight[rank if tag == "D" else 0])[tag]
    torch.manual_seed(7)
    model = wrap_blocks_and_norms(gpt(dropout=0.1 if tag == "D" else 0.0))
    opt = fsdp_optimizer(model, lr=0.5)  # hyperparameters come from the checkpoint
    sched = _scheduler(opt)
    extra = fsdp_lite.load_checkpoint(f"{tmp}/{tag}", model, opt)
    assert extra["step"] == SAVE_AT
    sched.load_state_dict(extra["sched"])
    torch.set_rng_state(extra["rng"])
    losses = []
    for step in range(SAVE_AT, STEPS):
        loss = model(*local_batch(step, rank, world))[1]
        loss.backward()
        opt.step(), opt.zero_grad(), sched.step()
        losses.append(loss.detach())
        if tag == "R":
            got, ref = mean_loss(loss), want["ref_losses"][step]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=0, msg=f"W={world} step {step}")
    sd = model.state_dict()
    osd = fsdp_lite.full_optim_state_dict(model, opt, rank0_only=False)
    if tag == "D":  # same world size, same RNG: the very same run
        assert [x.item() for x in losses] == [x.item() for x in want["losses"][SAVE_AT:]]
        assert_state_dicts(sd, want["sd"], what="resumed params")
        assert_optim_states(osd, want["osd"])
    else:  # resharded: the reference, to fp32 rounding
        assert_state_dicts(sd, want["ref_sd"], atol=1e-5, what=f"W={world} params")
        assert_optim_states(osd, want["ref_osd"], rtol=1e-4, atol=1e-7)
    return pack(extra)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[str, list[bytes]]:
    tmp = str(tmp_path_factory.mktemp("resume"))
    return tmp, run_distributed(_train_and_save, 2, tmp)


def test_resume_is_bitwise_identical(straight) -> None:
    tmp, want = straight
    extras = [unpack(e) for e in run_distributed(_resume, 2, tmp, "D", want)]
    assert [e["rng"].sum().item() for e in extras] != [extras[0]["rng"].sum().item()] * 2


@pytest.mark.parametrize("world", [1, 3])
def test_reshard_on_load_matches_reference(straight, world: int) -> None:
    tmp, want = straight
    run_distributed(_resume, world, tmp, "R", want)
