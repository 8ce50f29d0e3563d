"""Optimizer state keyed by parameter names with original shapes: consolidated on rank 0
it equals a single-process AdamW's (two param groups, one without weight decay); loaded
into a sharded optimizer at W=3 (uneven shards) training continues like the reference;
mismatched groups or parameters are refused with errors that say what differs."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import gpt, wrap_blocks
from ckpt_cases import (
    NORM_LR,
    assert_optim_states,
    assert_state_dicts,
    fsdp_optimizer,
    global_batch,
    local_batch,
    mean_loss,
    named_optim_state,
    reference_optimizer,
    wrap_blocks_and_norms,
)

import fsdp_lite
from fsdp_lite.testing import run_distributed


def _train(model, opt, ref, ref_opt, rank: int, world: int, steps: range) -> None:
    for step in steps:
        loss = model(*local_batch(step, rank, world))[1]
        loss.backward()
        opt.step(), opt.zero_grad()
        ref_loss = ref(*global_batch(step))[1]
        ref_loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        torch.testing.assert_close(mean_loss(loss), ref_loss.item(), rtol=1e-5, atol=0)


def _optim_state(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = gpt()
    model = wrap_blocks_and_norms(copy.deepcopy(ref))
    opt, ref_opt = fsdp_optimizer(model), reference_optimizer(ref)
    _train(model, opt, ref, ref_opt, rank, world, range(2))
    # consolidated on rank 0 only
    osd = fsdp_lite.full_optim_state_dict(model, opt)
    want = named_optim_state(ref, ref_opt)
    if rank == 0:
        assert_optim_states(osd, want, rtol=1e-4, atol=1e-7)
        assert osd["state"]["wte.weight"]["exp_avg"].shape == (64, 32)
        assert osd["param_groups"][1]["weight_decay"] == 0.0
        assert osd["param_groups"][1]["lr"] == NORM_LR
    else:
        assert osd == {}
    # the reference's state (never sharded) into a fresh sharded model and optimizer
    for rank0_only in (True, False):
        torch.manual_seed(rank + 5)
        fresh = wrap_blocks_and_norms(gpt())
        fresh_opt = fsdp_optimizer(fresh, lr=0.5)  # lr comes back from the state dict
        give = rank == 0 or not rank0_only
        fresh.load_state_dict(ref.state_dict() if give else {}, rank0_only=rank0_only)
        fsdp_lite.load_full_optim_state_dict(fresh, fresh_opt, want if give else {}, rank0_only)
        got = fsdp_lite.full_optim_state_dict(fresh, fresh_opt, rank0_only=False)
        assert_optim_states(got, want)  # exact: only slicing and concatenation happened
    trained_ref, trained_ref_opt = copy.deepcopy(ref), None
    trained_ref_opt = reference_optimizer(trained_ref)
    trained_ref_opt.load_state_dict(ref_opt.state_dict())
    _train(fresh, fresh_opt, trained_ref, trained_ref_opt, rank, world, range(2, 4))
    assert_state_dicts(fresh.state_dict(), trained_ref.state_dict(), atol=1e-5, what="continued")
    _errors(model, opt, want, rank)


def _errors(model, opt, want, rank: int) -> None:
    one_group = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="2 param groups, this one 1"):
        fsdp_lite.load_full_optim_state_dict(model, one_group, want)
    swapped = copy.deepcopy(want)
    swapped["param_groups"][0]["params"].append(swapped["param_groups"][1]["params"].pop())
    with pytest.raises(ValueError, match="param group 0 holds different parameters"):
        fsdp_lite.load_full_optim_state_dict(model, opt, swapped)
    partial = copy.deepcopy(want)
    del partial["state"]["blocks.0.attn.qkv.bias"]
    with pytest.raises(RuntimeError, match="partial optimizer state"):
        fsdp_lite.load_full_optim_state_dict(model, opt, partial)
    foreign = copy.deepcopy(want)
    foreign["state"]["encoder.weight"] = foreign["state"]["wte.weight"]
    with pytest.raises(RuntimeError, match=r"does not hold: \['encoder.weight'\]"):
        fsdp_lite.load_full_optim_state_dict(model, opt, foreign)
    misshapen = copy.deepcopy(want)
    misshapen["state"]["wpe.weight"]["exp_avg"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="'exp_avg' of 'wpe.weight' has shape"):
        fsdp_lite.load_full_optim_state_dict(model, opt, misshapen)
    with pytest.raises(ValueError, match="not an optimizer state dict"):
        fsdp_lite.load_full_optim_state_dict(model, opt, {"exp_avg": 1})
    with pytest.raises(ValueError, match="not an optimizer state dict"):  # on every rank
        bad = {"exp_avg": 1} if rank == 0 else {}
        fsdp_lite.load_full_optim_state_dict(model, opt, bad, rank0_only=True)
    other = wrap_blocks(gpt())
    with pytest.raises(ValueError, match="not a parameter of this model"):
        fsdp_lite.full_optim_state_dict(model, torch.optim.AdamW(other.parameters()))


@pytest.mark.parametrize("world", [3])
def test_optim_state_matches_reference(world: int) -> None:
    run_distributed(_optim_state, world)
