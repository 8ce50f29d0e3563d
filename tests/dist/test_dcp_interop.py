"""Runs move between PyTorch FSDP2 and fsdp_lite through DCP checkpoints, both ways, each
continuing equal to a single-process reference that never stopped (a GPT with a unit per
block, AdamW, gloo, the same global batch of 6 sequences at every world size):

- FSDP2 trains 3 steps at W=2 and saves ``{"model": msd, "optim": osd}`` from
  ``get_state_dict``; fsdp_lite resumes at W=2 and W=3, flat shards and whole params,
  and trains 2 more steps: losses and parameters equal the reference's;
- the same run saved as torchtitan does (model keys at the top level, the optimizer's
  flattened per parameter under ``optimizer.``) and as a weights-only export (model keys,
  no prefix) loads too;
- fsdp_lite trains 3 steps at W=2 and saves; FSDP2 resumes with ``dcp.load`` and
  ``set_state_dict`` (the snippet in docs/api.md), optimizer state included, and trains 2
  more steps equal to the reference.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_lite
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import FP32
from tests.dist.cases import gpt, gpt_loss, mean_over_ranks, token_batch, wrap_blocks

SAVED_AT, STEPS, GLOBAL = 3, 5, 6


def _batch(step: int, rank: int, world: int) -> tuple:
    return tuple(t.chunk(world)[rank] for t in token_batch(1, step, per_rank=GLOBAL))


def _adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = gpt()
    opt = _adamw(model)
    losses = []
    for step in range(STEPS):
        loss = gpt_loss(model, _batch(step, 0, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _train(model, opt, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        loss = gpt_loss(model, _batch(step, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    return losses


def _check(what: str, losses: list[float], state: dict, ref_losses, ref_state) -> None:
    for step, (got, want) in enumerate(zip(losses, ref_losses[SAVED_AT:], strict=True)):
        assert abs(got - want) <= FP32.loss_rtol * abs(want), (what, SAVED_AT + step, got, want)
    for name, want in ref_state.items():
        got = state[name].full_tensor() if hasattr(state[name], "full_tensor") else state[name]
        torch.testing.assert_close(got, want, rtol=0, atol=FP32.param_atol, msg=f"{what} {name}")


def _fsdp2(world: int):
    torch.manual_seed(0)
    model = gpt()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _adamw(model)


# -- from FSDP2 to fsdp_lite ------------------------------------------------------------


def _fsdp2_saves(rank: int, world: int, tmp: str) -> None:
    model, opt = _fsdp2(world)
    _train(model, opt, range(SAVED_AT), rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, "fsdp2"))
    flat = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    titan = {**get_model_state_dict(model), "optimizer": flat}
    dcp.save(titan, checkpoint_id=os.path.join(tmp, "torchtitan"))
    dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(tmp, "weights"))


def _fsdp_lite_resumes(rank: int, world: int, tmp: str) -> None:
    ref_losses, ref_state = _reference()
    for layout in ("flat shards", "whole params"):
        for saved in ("fsdp2", "torchtitan"):
            torch.manual_seed(rank + 7)  # nothing of this init survives the load
            model = wrap_blocks(
                gpt(), optimizer_params="whole" if layout == "whole params" else None
            )
            opt = _adamw(model)
            extra = fsdp_lite.load_checkpoint(os.path.join(tmp, saved), model, opt)
            assert extra == {}, extra
            losses = _train(model, opt, range(SAVED_AT, STEPS), rank, world)
            what = f"W={world} {layout}, from {saved}"
            _check(what, losses, model.state_dict(), ref_losses, ref_state)
    model = wrap_blocks(gpt())
    fsdp_lite.load_checkpoint(os.path.join(tmp, "weights"), model)
    fresh = wrap_blocks(gpt())
    fsdp_lite.load_checkpoint(os.path.join(tmp, "fsdp2"), fresh)
    for name, value in fresh.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_fsdp2_checkpoints_resume_in_fsdp_lite(tmp_path) -> None:
    run_distributed(_fsdp2_saves, 2, str(tmp_path))
    for world in (2, 3):
        run_distributed(_fsdp_lite_resumes, world, str(tmp_path))


# -- from fsdp_lite to FSDP2 ------------------------------------------------------------


def _fsdp_lite_saves(rank: int, world: int, tmp: str) -> None:
    torch.manual_seed(0)
    model = wrap_blocks(gpt())
    opt = _adamw(model)
    _train(model, opt, range(SAVED_AT), rank, world)
    fsdp_lite.save_checkpoint(os.path.join(tmp, "fsdp_lite"), model, opt, extra={"step": 3})


def _fsdp2_resumes(rank: int, world: int, tmp: str) -> None:
    ref_losses, ref_state = _reference()
    model, opt = _fsdp2(world)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(tmp, "fsdp_lite"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = _train(model, opt, range(SAVED_AT, STEPS), rank, world)
    _check(f"FSDP2 W={world}", losses, model.state_dict(), ref_losses, ref_state)


def test_fsdp_lite_checkpoints_resume_in_fsdp2(tmp_path) -> None:
    run_distributed(_fsdp_lite_saves, 2, str(tmp_path))
    run_distributed(_fsdp2_resumes, 2, str(tmp_path))


@pytest.mark.parametrize("strict", [True, False])
def test_a_checkpoint_of_another_model_names_its_keys(tmp_path, strict: bool) -> None:
    run_distributed(_fsdp2_saves, 2, str(tmp_path))
    run_distributed(_other_model, 2, str(tmp_path), strict)


def _other_model(rank: int, world: int, tmp: str, strict: bool) -> None:
    """A deeper GPT than the checkpoint's: strict refuses, naming the keys, before anything
    changed; strict=False loads the keys both have and warns with the rest."""
    torch.manual_seed(1)
    model = wrap_blocks(gpt(n_layer=3))
    before = copy.deepcopy(model.state_dict())
    path = os.path.join(tmp, "fsdp2")
    if strict:
        with pytest.raises(fsdp_lite.CheckpointError, match=r"missing keys: \['blocks.2"):
            fsdp_lite.load_checkpoint(path, model)
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name]), name
        return
    with pytest.warns(UserWarning, match=r"left as they were: \['blocks.2"):
        fsdp_lite.load_checkpoint(path, model, strict=False)
    after = model.state_dict()
    assert torch.equal(after["blocks.2.mlp.fc.weight"], before["blocks.2.mlp.fc.weight"])
    assert not torch.equal(after["blocks.0.mlp.fc.weight"], before["blocks.0.mlp.fc.weight"])
