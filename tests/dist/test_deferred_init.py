"""Deferred init: a model built on the meta device, wrapped unit by unit, equals the eager
build with rank 0's seed on every rank; wrapping peaks near one unit, far under the model;
a module that cannot be initialized is named in the error."""

from __future__ import annotations

import functools
import os
import re
import tempfile

import pytest
import torch
from cases import gpt, gpt_run, token_batch, wrap_blocks
from torch import nn

import fsdp_lite
from fsdp_lite.testing import GPTConfig, run_distributed
from fsdp_lite.testing.models import GPT
from fsdp_lite.testing.reference import compare_training


def _meta(make, seed: int):
    torch.manual_seed(seed)
    with torch.device("meta"):
        return make()


def _plain_stack() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(5, 7),
        nn.LayerNorm(7),
        nn.Sequential(nn.Linear(7, 9), nn.BatchNorm1d(9)),
        nn.Embedding(3, 9),
        nn.Linear(9, 2),
    )


def _equals_eager(rank: int) -> None:
    for make, policy in (
        (gpt, fsdp_lite.wrap.by_type(fsdp_lite.testing.models.Block)),
        (functools.partial(gpt, tie_weights=False, n_layer=3), fsdp_lite.wrap.by_size(3000)),
        (_plain_stack, fsdp_lite.wrap.by_type(nn.Sequential)),
    ):
        torch.manual_seed(0)
        want = make().state_dict()
        model = fsdp_lite.FSDPModule(_meta(make, seed=rank * 7), auto_wrap_policy=policy)
        got = model.state_dict()
        assert list(got) == list(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k


def _training(world: int) -> None:
    def wrap_meta(_ignored, **kwargs):
        return wrap_blocks(_meta(gpt, seed=1234), **kwargs)

    compare_training(gpt_run("meta-built", world, wrap=wrap_meta))
    mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16)
    compare_training(
        gpt_run("meta-built", world, "bf16", wrap=functools.partial(wrap_meta, mixed_precision=mp))
    )


def _peak_bytes_while(fn) -> int:
    """Peak of live CPU allocator bytes while ``fn`` runs, from the profiler's allocator
    events (every allocation and free, in order)."""
    cpu = torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[cpu], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _wrapping_peak(world: int) -> dict:
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=128)
    meta = _meta(lambda: GPT(cfg), seed=0)
    full = sum(p.numel() * 4 for p in meta.parameters())
    block = sum(p.numel() * 4 for p in meta.blocks[0].parameters())
    root = full - cfg.n_layer * block
    box = {}
    peak = _peak_bytes_while(lambda: box.setdefault("m", wrap_blocks(meta)))
    shards = box["m"].memory_stats()["shard_bytes"]
    figures = {"full_model": full, "largest_unit": max(block, root), "shards": shards, "peak": peak}
    # The shards (1/W of the model) are what this rank keeps anyway; beyond them, wrapping
    # holds about one unit's full parameters at a time, never the model.
    assert peak <= 1.1 * (max(block, root) + shards), figures
    assert peak - shards < 0.25 * full, figures
    return figures


def _errors() -> None:
    class NoInit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

    for make, needle in (
        (
            lambda: nn.Sequential(nn.Linear(2, 3), NoInit()),
            "module '1' (NoInit) is on the meta device and has no reset_parameters",
        ),
    ):
        with pytest.raises(RuntimeError, match=re.escape(needle)):
            fsdp_lite.FSDPModule(_meta(make, 0))
    # param_init_fn covers modules without reset_parameters
    model = fsdp_lite.FSDPModule(
        _meta(lambda: nn.Sequential(nn.Linear(2, 3), NoInit()), 0),
        param_init_fn=lambda m: [nn.init.ones_(p) for p in m.parameters(recurse=False)],
    )
    assert model.state_dict()["1.w"].eq(1).all()


def _filled_from_checkpoint(tmp: str) -> None:
    """Meta model + no_init + load_checkpoint: the checkpoint's values, never the full model."""
    torch.manual_seed(5)
    trained = wrap_blocks(gpt())
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    trained(*token_batch(1, 0))[1].backward()
    opt.step()
    fsdp_lite.save_checkpoint(tmp, trained)
    model = wrap_blocks(_meta(gpt, seed=0), param_init_fn=fsdp_lite.deferred_init.no_init)
    fsdp_lite.load_checkpoint(tmp, model)
    want = trained.state_dict()
    got = model.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _deferred(rank: int, world: int, tmp: str) -> dict:
    _filled_from_checkpoint(tmp)
    _equals_eager(rank)
    _training(world)
    _errors()
    return _wrapping_peak(world)


@pytest.mark.parametrize("world", [2])
def test_meta_built_model_equals_eager_and_wraps_in_unit_sized_memory(world: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print(run_distributed(_deferred, world, os.path.join(tmp, "ckpt"))[0])
