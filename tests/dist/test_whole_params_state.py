"""Optimizer state and checkpoints of the user's parameters, across layouts and sizes.

A W=2 run trains 3 steps in one layout beside a single-process reference (same
optimizers), checks ``full_optim_state_dict`` of every optimizer against the
reference's (keyed by names, original shapes), then saves a checkpoint and a full
state dict. New W=3 processes load them into a model wrapped in another layout and
train steps 4-6: losses and parameters match the reference that never stopped.

- Muon + AdamW, whole params at W=2 -> whole params at W=3 (checkpoint);
- AdamW decay groups, whole params -> the default layout with use_orig_params
  (checkpoint, and full state dict + full optimizer state dict);
- one AdamW over flat shards (the default layout) -> whole params, one group.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from cases import gpt, wrap_blocks
from ckpt_cases import (
    assert_optim_states,
    global_batch,
    local_batch,
    named_optim_state,
    pack,
    unpack,
)
from test_whole_params import decay_groups, fp32_newton_schulz, muon_and_adamw

import fsdp_lite
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests

STEPS, SAVE_AT = 6, 3


def mean_over_ranks(loss: torch.Tensor) -> float:
    x = loss.detach().clone()
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()


def one_adamw(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)]


# tag -> (layout saved at W=2, layout loaded at W=3, optimizers, how it is restored)
CASES = {
    "muon whole->whole": (
        {"optimizer_params": "whole"}, {"optimizer_params": "whole"}, muon_and_adamw, "ckpt",
    ),
    "decay whole->orig": (
        {"optimizer_params": "whole"}, {"use_orig_params": True}, decay_groups, "ckpt",
    ),
    "decay whole->orig, full dicts": (
        {"optimizer_params": "whole"}, {"use_orig_params": True}, decay_groups, "full",
    ),
    "flat->whole": ({}, {"optimizer_params": "whole"}, one_adamw, "ckpt"),
}  # fmt: skip


def _step(opts: list) -> None:
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad()


def _train_and_save(rank: int, world: int, tmp: str) -> dict:
    torch.optim._muon._zeropower_via_newtonschulz = fp32_newton_schulz  # see test_whole_params
    out = {}

    def case(tag: str) -> None:
        saved, _, make_opts, how = CASES[tag]
        torch.manual_seed(0)
        ref = gpt(n_layer=3)
        model = wrap_blocks(copy.deepcopy(ref), **saved)
        opts, ref_opts = make_opts(model), make_opts(ref)
        losses = []
        for step in range(STEPS):
            if step == SAVE_AT:
                for got, want in zip(opts, ref_opts, strict=True):
                    osd = fsdp_lite.full_optim_state_dict(model, got, rank0_only=False)
                    assert_optim_states(osd, named_optim_state(ref, want), rtol=1e-4, atol=1e-6)
                if how == "ckpt":
                    fsdp_lite.save_checkpoint(f"{tmp}/{tag}", model, opts)
                else:
                    osds = [fsdp_lite.full_optim_state_dict(model, o) for o in opts]
                    sd = model.state_dict()  # collective, as full_optim_state_dict
                    if rank == 0:
                        torch.save((sd, osds), f"{tmp}/{tag}.pt")
            ref_loss = ref(*global_batch(step))[1]
            ref_loss.backward()
            _step(ref_opts)
            losses.append(ref_loss.item())
            if step < SAVE_AT:
                loss = model(*local_batch(step, rank, world))[1]
                loss.backward()
                _step(opts)
                assert abs(mean_over_ranks(loss) - losses[-1]) <= 1e-5 * losses[-1], step
        out[tag] = pack((ref.state_dict(), losses))

    results = run_subtests((tag, functools.partial(case, tag)) for tag in CASES)
    return {"results": results, **out}


def _resume(rank: int, world: int, tmp: str, refs: dict) -> dict:
    torch.optim._muon._zeropower_via_newtonschulz = fp32_newton_schulz

    def case(tag: str) -> None:
        _, loaded, make_opts, how = CASES[tag]
        torch.manual_seed(1)  # different weights: everything must come from the checkpoint
        model = wrap_blocks(gpt(n_layer=3), **loaded)
        opts = make_opts(model)
        if how == "ckpt":
            fsdp_lite.load_checkpoint(f"{tmp}/{tag}", model, opts)
        else:
            sd, osds = torch.load(f"{tmp}/{tag}.pt", weights_only=False)
            model.load_state_dict(sd)
            for o, osd in zip(opts, osds, strict=True):
                fsdp_lite.load_full_optim_state_dict(model, o, osd)
        want, losses = unpack(refs[tag])
        for step in range(SAVE_AT, STEPS):
            loss = model(*local_batch(step, rank, world))[1]
            loss.backward()
            _step(opts)
            got_loss = mean_over_ranks(loss)
            assert abs(got_loss - losses[step]) <= 1e-5 * losses[step], (step, got_loss, losses)
        got = model.state_dict()
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=2e-5, msg=f"{tag} {k}")

    return run_subtests((tag, functools.partial(case, tag)) for tag in CASES)


def test_state_across_layouts_and_world_sizes(tmp_path):
    saved = run_distributed(_train_and_save, 2, str(tmp_path))
    assert_subtests_passed([r["results"] for r in saved])
    refs = {tag: saved[0][tag] for tag in CASES}
    assert_subtests_passed(run_distributed(_resume, 3, str(tmp_path), refs))
