"""The optimizer sees the user's parameters.

``use_orig_params=True``: ``named_parameters()`` yields this rank's piece of each
original parameter under its name, so per-parameter groups (no weight decay for biases,
norms and embeddings) train equal to the same groups on one process.
``optimizer_params="whole"``: each rank owns whole original parameters, shaped, so
``torch.optim.Muon`` steps its matrices unchanged. Every case against the single-process
reference: groups, Muon (fp32, bf16) and HF Llama at W=2 and W=3; the compositions (clip,
no_sync, checkpointing, offload, ties, frozen, hand-wrapped, meta-built, empty shards) at
W=3, where shards are uneven and some rank owns nothing of a unit.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from cases import (
    cross_tied_gpt,
    frozen_gpt,
    gpt,
    gpt_run,
    token_batch,
    wrap_blocks,
    wrap_by_hand,
)
from ckpt_cases import wrap_blocks_and_norms
from test_checkpointing import unit_inside, unit_outside
from test_deferred_init import _meta

import fsdp_lite
from fsdp_lite.core import collectives
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import compare_runs
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests


def decay_groups(model: torch.nn.Module, **kw) -> list[torch.optim.Optimizer]:
    """nanoGPT's configure_optimizers: decay matrices, not biases, norms (by ndim);
    ``kw``: e.g. fused=True (one kernel over every piece)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for _, p in named if p.ndim >= 2]
    rest = [p for _, p in named if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return [torch.optim.AdamW(groups, lr=1e-3, eps=1e-6, **kw)]


def muon_and_adamw(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """Muon on the blocks' matrices, AdamW on everything else (lr 1e-3: the rate the
    reference tolerances were measured at)."""
    named = list(model.named_parameters())
    mats = [p for n, p in named if p.ndim == 2 and "blocks." in n]
    rest = [p for n, p in named if not (p.ndim == 2 and "blocks." in n)]
    return [torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=1e-3, eps=1e-6)]


def fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """torch's Muon orthogonalizes in bf16: two runs whose gradients differ by fp32
    summation order (the reference sums the global batch at once) then round apart by a
    bf16 ulp and drift far beyond fp32 tolerance. The same iteration in fp32, patched in
    for both sides of the tight comparisons; one run keeps torch's own."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    x = (x.T if tall else x) / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def llama_muon(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """Llama: Muon on the decoder layers' matrices, AdamW on embeddings, head and norms."""
    named = list(model.named_parameters())
    mats = [p for n, p in named if p.ndim == 2 and ".layers." in n]
    rest = [p for n, p in named if not (p.ndim == 2 and ".layers." in n)]
    return [torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=1e-3, eps=1e-6)]


def wrap_llama(model: torch.nn.Module, **kw) -> fsdp_lite.FSDPModule:
    layers = fsdp_lite.wrap.by_type(*fsdp_lite.wrap.transformer_layers(model))
    policy = fsdp_lite.wrap.any_of(layers, fsdp_lite.wrap.embeddings_and_head(model))
    return fsdp_lite.FSDPModule(model, auto_wrap_policy=policy, **kw)


def _llama_runs(world: int) -> list:
    from hf_cases import hf_run, llama

    bf16 = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16)
    return [
        hf_run(f"llama muon, whole params W={world}", world, llama, optimizers=llama_muon,
               wrap=functools.partial(wrap_llama, optimizer_params="whole")),
        hf_run(f"llama muon, whole params W={world}", world, llama, "bf16",
               optimizers=llama_muon,
               wrap=functools.partial(wrap_llama, optimizer_params="whole", mixed_precision=bf16)),
        hf_run(f"llama decay groups, default layout W={world}", world,
               functools.partial(llama, tie=True), optimizers=decay_groups,
               wrap=functools.partial(wrap_llama, use_orig_params=True)),
    ]  # fmt: skip


def _runs(world: int, tmp: str) -> list:
    dropout_gpt = functools.partial(gpt, dropout=0.1)
    orig = functools.partial(wrap_blocks, use_orig_params=True)
    whole = functools.partial(wrap_blocks, optimizer_params="whole")
    whole_bf16 = functools.partial(
        wrap_blocks,
        optimizer_params="whole",
        mixed_precision=fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16),
    )
    core = [
        gpt_run("decay groups, default layout", world, wrap=orig, optimizers=decay_groups),
        gpt_run("decay groups, whole params", world, wrap=whole, optimizers=decay_groups),
        gpt_run("muon, whole params", world, wrap=whole, optimizers=muon_and_adamw),
        gpt_run("muon, whole params", world, "bf16", wrap=whole_bf16, optimizers=muon_and_adamw),
    ]
    if world < 3:  # the compositions at W=3 only: shards uneven, some ranks own none
        return core
    return core + [
        gpt_run("muon, whole params, clip", world, wrap=whole, optimizers=muon_and_adamw,
                clip=0.05),
        gpt_run("muon, whole params, no_sync", world, wrap=whole, optimizers=muon_and_adamw,
                accumulate=2),
        gpt_run("muon, whole params, by hand", world,
                wrap=functools.partial(wrap_by_hand, optimizer_params="whole"),
                optimizers=muon_and_adamw),
        gpt_run("muon, whole params, cross-unit tie", world, wrap=whole,
                make_model=cross_tied_gpt, optimizers=muon_and_adamw),
        gpt_run("muon, whole params, checkpointed blocks", world, make_model=dropout_gpt,
                wrap=functools.partial(unit_outside, reentrant=False, optimizer_params="whole"),
                optimizers=muon_and_adamw, replay_rng=True),
        gpt_run("decay groups, default layout, checkpoint wrapper outside", world,
                wrap=functools.partial(unit_inside, reentrant=False, use_orig_params=True),
                optimizers=decay_groups),
        gpt_run("muon, whole params, CPU offload", world, optimizers=muon_and_adamw,
                wrap=functools.partial(wrap_blocks, optimizer_params="whole",
                                       offload=fsdp_lite.CPUOffload())),
        gpt_run("decay groups, default layout, SSD offload", world, optimizers=decay_groups,
                wrap=functools.partial(wrap_blocks, use_orig_params=True,
                                       offload=fsdp_lite.SSDOffload(tmp))),
        gpt_run("muon, whole params, frozen params", world, make_model=frozen_gpt,
                wrap=whole, optimizers=muon_and_adamw),
        gpt_run("muon, whole params", world, raf=False, optimizers=muon_and_adamw,
                wrap=functools.partial(wrap_blocks, optimizer_params="whole",
                                       reshard_after_forward=False)),
        gpt_run("muon, whole params, norms as units (a rank owns none of each)", world,
                wrap=functools.partial(wrap_blocks_and_norms, optimizer_params="whole"),
                optimizers=muon_and_adamw, clip=0.05, accumulate=2),
        gpt_run("muon, whole params, norms as units, SSD offload", world,
                wrap=functools.partial(wrap_blocks_and_norms, optimizer_params="whole",
                                       offload=fsdp_lite.SSDOffload(tmp + "/norms")),
                optimizers=muon_and_adamw),
        gpt_run("decay groups, whole params, fused AdamW", world, wrap=whole,
                optimizers=functools.partial(decay_groups, fused=True)),
        gpt_run("decay groups, default layout, foreach AdamW", world, wrap=orig,
                optimizers=functools.partial(decay_groups, foreach=True)),
        gpt_run("muon, whole params, meta-built", world, optimizers=muon_and_adamw,
                wrap=lambda _ignored: wrap_blocks(_meta(gpt, seed=1234), optimizer_params="whole")),
        gpt_run("muon, whole params, untied, 5 blocks", world, wrap=whole,
                make_model=functools.partial(gpt, n_layer=5, tie_weights=False),
                optimizers=muon_and_adamw),
    ]  # fmt: skip


def _train(rank: int, world: int, tmp: str) -> dict:
    stock = torch.optim._muon._zeropower_via_newtonschulz
    torch.optim._muon._zeropower_via_newtonschulz = fp32_newton_schulz
    try:
        results = compare_runs(_runs(world, tmp) + _llama_runs(world))
    finally:
        torch.optim._muon._zeropower_via_newtonschulz = stock
    stock_ns = gpt_run("muon, whole params, torch's bf16 Newton-Schulz", world, "bf16",
                       wrap=functools.partial(wrap_blocks, optimizer_params="whole"),
                       optimizers=muon_and_adamw)  # fmt: skip
    return {**results, **compare_runs([stock_ns])}


@pytest.mark.parametrize("world", [2, 3])
def test_trains_like_reference(world, tmp_path):
    assert_subtests_passed(run_distributed(_train, world, str(tmp_path)))


# -- what each rank holds, and what a step moves ------------------------------------


def _names_and_refusals(rank: int, world: int) -> dict:
    def names_are_the_reference_names():
        ref = dict(gpt().named_parameters())
        for kw in ({"use_orig_params": True}, {"optimizer_params": "whole"}):
            model = wrap_blocks(gpt(), **kw)
            mine = {n: tuple(p.shape) for n, p in model.named_parameters()}
            everyone = collectives.all_gather_object(mine, dist.group.WORLD)
            union = set().union(*everyone)
            assert union == set(ref), (kw, sorted(union ^ set(ref)))
            if "optimizer_params" in kw:  # each parameter on one rank, whole and shaped
                assert sum(len(e) for e in everyone) == len(ref)
                assert all(s == tuple(ref[n].shape) for n, s in mine.items())
            # attribute access still reaches the module, not this rank's piece
            assert isinstance(model.blocks[0].attn, torch.nn.Module)

    def muon_refuses_partial_pieces():
        model = wrap_blocks(gpt(), use_orig_params=True)
        mats = [p for n, p in model.named_parameters() if p.ndim == 2 and "blocks." in n]
        opt = torch.optim.Muon(mats, lr=0.02)
        x, y = token_batch(world, 0)
        model(x.chunk(world)[rank], y.chunk(world)[rank])[1].backward()
        with pytest.raises(RuntimeError, match="optimizer_params='whole'"):
            opt.step()

    def empty_shards_when_a_unit_has_fewer_parameters_than_ranks():
        model = wrap_blocks_and_norms(gpt(), optimizer_params="whole")
        flats = [f for u in units_of(model) for f in u.flat_params]
        empty = [f for f in flats for r in range(world) if f.bounds[r] == f.bounds[r + 1]]
        assert world < 3 or empty, "at W=3 a LayerNorm unit (2 parameters) leaves a rank none"
        assert all(p.numel() > 0 for p in model.parameters())  # no empty optimizer tensor

    def grads_follow_zero_grad():
        """zero_grad(set_to_none=True) drops the grads (a grad kept by the user keeps its
        values); set_to_none=False zeroes them in place; an assigned grad is added to; a
        grad set to None stays None through clipping; requires_grad turned off after
        wrapping: no grad, so no optimizer steps it."""
        model = wrap_blocks(gpt(), optimizer_params="whole")
        params = list(model.parameters())
        x, y = (t.chunk(world)[rank] for t in token_batch(world, 0))
        model(x, y)[1].backward()
        assert all(p.grad is not None for p in params)
        first = [p.grad.clone() for p in params]
        model.zero_grad(set_to_none=False)
        assert all(not g.any() for f in units_of(model)[0].flat_params for g in f.grads())
        model(x, y)[1].backward()
        assert all(torch.allclose(p.grad, g) for p, g in zip(params, first, strict=True))
        kept = [p.grad for p in params]
        model.zero_grad()
        assert all(p.grad is None for p in params)
        params[0].grad = torch.ones_like(params[0])
        model(x, y)[1].backward()
        assert torch.allclose(params[0].grad, first[0] + 1)
        assert all(torch.equal(k, g) for k, g in zip(kept, first, strict=True)), "user's copy"
        params[1].grad = None
        model.clip_grad_norm_(1.0)
        assert params[1].grad is None
        params[2].requires_grad_(False)
        model.zero_grad()
        model(x, y)[1].backward()
        assert params[2].grad is None and params[3].grad is not None
        with pytest.raises(TypeError, match="cut the optimizer's parameters"):
            model.to("meta")

    def scaler_unscales_and_agrees_on_overflow():
        """ShardedGradScaler over orig params: unscale_ gives the unscaled grads; an inf in
        one rank's piece makes every rank skip the step."""
        model = wrap_blocks(gpt(), optimizer_params="whole")
        params = list(model.parameters())
        opt = decay_groups(model)[0]
        scaler = fsdp_lite.ShardedGradScaler("cpu", init_scale=2.0**10)
        x, y = (t.chunk(world)[rank] for t in token_batch(world, 0))
        model(x, y)[1].backward()
        plain = [p.grad.clone() for p in params]
        opt.zero_grad()
        scaler.scale(model(x, y)[1]).backward()
        scaler.unscale_(opt)
        pairs = zip(params, plain, strict=True)
        assert all(torch.allclose(p.grad, g, rtol=1e-4, atol=1e-9) for p, g in pairs)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scaler.scale(model(x, y)[1]).backward()
        if rank == 0:
            params[0].grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
        assert scaler.get_scale() < 2.0**10

    def summon_shows_full_parameters_and_writes_back():
        """Inside summon_full_params the full parameters replace this rank's pieces under
        the same names; an edit written back reaches the owner's piece."""
        ref = gpt()
        model = wrap_blocks(copy.deepcopy(ref), optimizer_params="whole")
        with model.summon_full_params():
            full = dict(model.named_parameters())
            assert {n: p.shape for n, p in full.items()} == {
                n: p.shape for n, p in ref.named_parameters()
            }
            with torch.no_grad():
                full["blocks.0.mlp.fc.weight"].add_(1.0)
        mine = dict(model.named_parameters())
        if "blocks.0.mlp.fc.weight" in mine:
            want = ref.blocks[0].mlp.fc.weight + 1.0
            assert torch.allclose(mine["blocks.0.mlp.fc.weight"], want)

    return run_subtests(
        [
            ("names are the reference's", names_are_the_reference_names),
            ("summon_full_params", summon_shows_full_parameters_and_writes_back),
            ("ShardedGradScaler", scaler_unscales_and_agrees_on_overflow),
            ("Muon refuses partial pieces", muon_refuses_partial_pieces),
            ("grads follow zero_grad", grads_follow_zero_grad),
            ("empty shards", empty_shards_when_a_unit_has_fewer_parameters_than_ranks),
        ]
    )


def test_names_grads_and_refusals():
    assert_subtests_passed(run_distributed(_names_and_refusals, 3))


def layout_figures(world: int, n_layer: int = 8) -> dict:
    """One step of an ``n_layer`` GPT in each layout on a fake process group of ``world``
    ranks: collective calls and bytes, and each rank's owned bytes (whole params)."""
    figures = {}
    for kw in ({}, {"optimizer_params": "whole"}):
        model = wrap_blocks(gpt(n_layer=n_layer, tie_weights=False), **kw)
        x, y = token_batch(1, 0)
        fsdp_lite.reset_stats(model)
        model(x, y)[1].backward()
        ops = fsdp_lite.stats(model)["collectives"]
        flats = [f for u in units_of(model) for f in u.flat_params]
        owned = [
            sum((f.bounds[r + 1] - f.bounds[r]) * f.shard.element_size() for f in flats)
            for r in range(world)
        ]
        figures["whole" if kw else "default"] = {
            "calls": {k: ops[k]["calls"] for k in ("all_gather", "reduce_scatter")},
            "bytes": sum(ops[k]["bytes"] for k in ("all_gather", "reduce_scatter")),
            "owned": owned,
            "empty": sum(f.bounds[r] == f.bounds[r + 1] for f in flats for r in range(world)),
        }
    return figures


def _layout_worker() -> None:
    from fsdp_lite.testing.spawn import fake_group

    for world in range(2, 9):
        with fake_group(0, world):
            print(json.dumps({"world": world, **layout_figures(world)}), flush=True)


def test_layout_bytes_and_balance():
    """8 blocks, W=2..8: a step moves no more than 1.1x the default layout's bytes in the
    same calls; each rank owns within 1.3x of the mean; some rank owns nothing of a unit."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.dirname(__file__)])}
    code = "import test_whole_params as t; t._layout_worker()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["world"] for r in rows] == list(range(2, 9))
    for r in rows:
        default, whole = r["default"], r["whole"]
        assert whole["calls"] == default["calls"], r
        assert whole["bytes"] <= 1.1 * default["bytes"], r
        mean = sum(whole["owned"]) / len(whole["owned"])
        assert max(whole["owned"]) <= 1.3 * mean, r
    assert rows[-1]["whole"]["empty"] > 0, "at W=8 some rank owns nothing of some unit"
