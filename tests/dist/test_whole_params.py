"""The optimizer sees the user's parameters.

``use_orig_params=True``: ``named_parameters()`` yields this rank's piece of each
original parameter under its name, so per-parameter groups (no weight decay for biases,
norms and embeddings) train equal to the same groups on one process.
``whole_params=True``: each rank owns whole original parameters, shaped, so
``torch.optim.Muon`` steps its matrices unchanged. Every case against the single-process
reference, at W=2 and W=3 (where some rank owns nothing of a unit).
"""

from __future__ import annotations

import functools

import pytest
import torch
from cases import cross_tied_gpt, gpt, gpt_run, wrap_blocks, wrap_by_hand

import fsdp_lite
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import compare_runs
from fsdp_lite.testing.subtests import assert_subtests_passed


def decay_groups(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """nanoGPT's configure_optimizers: decay matrices, not biases, norms (by ndim)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for _, p in named if p.ndim >= 2]
    rest = [p for _, p in named if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return [torch.optim.AdamW(groups, lr=1e-3, eps=1e-6)]


def muon_and_adamw(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """The issue's recipe: Muon on the blocks' matrices, AdamW on everything else."""
    named = list(model.named_parameters())
    mats = [p for n, p in named if p.ndim == 2 and "blocks." in n]
    rest = [p for n, p in named if not (p.ndim == 2 and "blocks." in n)]
    return [torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=3e-3, eps=1e-6)]


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


def _runs(world: int) -> list:
    orig = functools.partial(wrap_blocks, use_orig_params=True)
    whole = functools.partial(wrap_blocks, whole_params=True)
    whole_bf16 = functools.partial(
        wrap_blocks,
        whole_params=True,
        mixed_precision=fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16),
    )
    return [
        gpt_run("decay groups, default layout", world, wrap=orig, optimizers=decay_groups),
        gpt_run("decay groups, whole params", world, wrap=whole, optimizers=decay_groups),
        gpt_run("muon, whole params", world, wrap=whole, optimizers=muon_and_adamw),
        gpt_run("muon, whole params", world, "bf16", wrap=whole_bf16, optimizers=muon_and_adamw),
        gpt_run("muon, whole params, clip", world, wrap=whole, optimizers=muon_and_adamw,
                clip=0.05),
        gpt_run("muon, whole params, no_sync", world, wrap=whole, optimizers=muon_and_adamw,
                accumulate=2),
        gpt_run("muon, whole params, by hand", world,
                wrap=functools.partial(wrap_by_hand, whole_params=True),
                optimizers=muon_and_adamw),
        gpt_run("muon, whole params, cross-unit tie", world, wrap=whole,
                make_model=cross_tied_gpt, optimizers=muon_and_adamw),
        gpt_run("muon, whole params, untied, 5 blocks", world, wrap=whole,
                make_model=functools.partial(gpt, n_layer=5, tie_weights=False),
                optimizers=muon_and_adamw),
    ]  # fmt: skip


def _train(rank: int, world: int) -> dict:
    stock = torch.optim._muon._zeropower_via_newtonschulz
    torch.optim._muon._zeropower_via_newtonschulz = fp32_newton_schulz
    try:
        results = compare_runs(_runs(world))
    finally:
        torch.optim._muon._zeropower_via_newtonschulz = stock
    stock_ns = gpt_run("muon, whole params, torch's bf16 Newton-Schulz", world, "bf16",
                       wrap=functools.partial(wrap_blocks, whole_params=True),
                       optimizers=muon_and_adamw)  # fmt: skip
    return {**results, **compare_runs([stock_ns])}


@pytest.mark.parametrize("world", [2, 3])
def test_trains_like_reference(world):
    assert_subtests_passed(run_distributed(_train, world))
