"""fsdp_lite over the dp dim of a (dp=2, tp=2) mesh (W=4, gloo) around models that
``parallelize_module`` made tensor (and sequence) parallel on the tp dim.

Every training case runs against a single-process reference of the unparallelized model
on the same global batch, split over the dp dim only (the two ranks of a TP group see the
same slice): losses every step, full gradients every step (``full_gradients`` gathers the
DTensor ones over tp too), full parameters at the end. Then what users do around a step
(state dicts, summon_full_params) and the inputs refused before anything changes.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
import tp_models
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from tp_models import SEQ, VOCAB, Block, Transformer

import fsdp_lite
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import BF16, Run, compare_runs
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests

STEPS = 3
# This model's bf16 loss is more sensitive than the GPT's BF16 was measured on: wrapped
# without TP (dp only, W=4) it errs by 1.9e-4 at step 2, with TP + SP by 2.8e-4 (measured
# 2026-11-28); 2.5x that. Gradients and updates keep BF16's own bounds (0.021 and 0.043
# measured), which catch a Partial gradient left unreduced over tp.
BF16_THIS_MODEL = dataclasses.replace(BF16, loss_rtol=7e-4)


@functools.cache
def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _dp_slice() -> tuple[int, int]:
    dp = _mesh()["dp"]
    return dp.get_local_rank(), dp.size()


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (8, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))


def _wrap_transformer(model: Transformer, sp: bool, **kw) -> fsdp_lite.FSDPModule:
    mesh = _mesh()
    tp_models.parallelize(model, mesh["tp"], sp)
    policy = fsdp_lite.wrap.by_type(Block)
    return fsdp_lite.FSDPModule(model, mesh=mesh["dp"], auto_wrap_policy=policy, **kw)


def _transformer_run(name: str, sp: bool, tied: bool = False, **kw) -> Run:
    wrap_kw = {k: kw.pop(k) for k in ("mixed_precision", "optimizer_params") if k in kw}
    return Run(
        name,
        make_model=functools.partial(Transformer, tied=tied),
        batch=_tokens,
        loss=_lm_loss,
        wrap=functools.partial(_wrap_transformer, sp=sp, **wrap_kw),
        steps=STEPS,
        data_slice=_dp_slice,
        **kw,
    )


def _mlp_run() -> Run:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randn(8, 8, generator=g), torch.randn(8, 7, generator=g)

    def wrap(model: nn.Sequential) -> fsdp_lite.FSDPModule:
        return fsdp_lite.FSDPModule(
            tp_models.parallelize_mlp(model, _mesh()["tp"]), mesh=_mesh()["dp"]
        )

    return Run(
        "MLP, uneven TP shards (7 = 4 + 3)",
        make_model=tp_models.mlp,
        batch=batch,
        loss=lambda m, b: F.mse_loss(m(b[0]), b[1]),
        wrap=wrap,
        steps=STEPS,
        data_slice=_dp_slice,
    )


def _training_runs() -> list[Run]:
    bf16 = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16)
    return [
        _mlp_run(),
        _transformer_run("transformer, TP", sp=False),
        _transformer_run("transformer, TP + SP", sp=True),
        _transformer_run("transformer, TP + SP, tied embeddings", sp=True, tied=True),
        _transformer_run("transformer, TP, tied embeddings", sp=False, tied=True),
        _transformer_run("transformer, TP + SP, bf16 gathers, fp32 masters", sp=True,
                         mixed_precision=bf16, tol=BF16_THIS_MODEL),
        _transformer_run("transformer, TP + SP, clip norm", sp=True, clip=0.05),
        _transformer_run("transformer, TP + SP, no_sync accumulation", sp=True, accumulate=2),
        _transformer_run("transformer, TP + SP, optimizer_params='pieces'", sp=True,
                         optimizer_params="pieces"),
    ]  # fmt: skip


def _state_dicts() -> None:
    """model.state_dict() gives the unwrapped model's plain full tensors; loading one
    (another model's) makes the forward equal to that model's."""
    torch.manual_seed(0)
    ref, other = Transformer(tied=True), Transformer(tied=True)
    model = _wrap_transformer(Transformer(tied=True), sp=True)
    model.load_state_dict(other.state_dict())
    got = model.state_dict()
    want = other.state_dict()
    assert list(got) == list(want), (list(got), list(want))
    for key, value in want.items():
        assert type(got[key]) is torch.Tensor, (key, type(got[key]))
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    x, _ = _tokens(0)
    torch.testing.assert_close(model(x), other(x), rtol=1e-5, atol=1e-5)
    del ref


def _summon() -> None:
    """Inside summon_full_params a TP parameter is the DTensor it was before wrapping
    (same placements, its full tensor the unwrapped model's); writeback lands in the shard."""
    torch.manual_seed(0)
    ref = Transformer()
    model = _wrap_transformer(Transformer(), sp=True)
    model.load_state_dict(ref.state_dict())
    wq = model.module.layers[0].attention.wq
    with fsdp_lite.FSDPModule.summon_full_params(model, writeback=True):
        assert isinstance(wq.weight, DTensor) and wq.weight.placements == (Shard(0),)
        torch.testing.assert_close(wq.weight.full_tensor(), ref.layers[0].attention.wq.weight)
        with torch.no_grad():
            wq.weight.mul_(2)
    torch.testing.assert_close(
        model.state_dict()["layers.0.attention.wq.weight"], 2 * ref.layers[0].attention.wq.weight
    )


def _parallelized_after_wrapping() -> None:
    """A colwise plan applied to a wrapped model finds no parameters to distribute (a
    rowwise one reads the placeholder weight and raises there): the first forward refuses."""
    model = fsdp_lite.FSDPModule(tp_models.mlp(), mesh=_mesh()["dp"])
    parallelize_module(model.module, _mesh()["tp"], {"0": ColwiseParallel()})
    with pytest.raises(ValueError, match="parallelize_module .* ran after"):
        model(torch.randn(2, 8))


def _dtensor_on_the_dp_dim() -> None:
    model = tp_models.parallelize_mlp(tp_models.mlp(), _mesh()["dp"])
    with pytest.raises(ValueError, match="mesh dim 'dp' shares ranks"):
        fsdp_lite.FSDPModule(model, mesh=_mesh()["dp"])
    for p in model.parameters():  # nothing changed: still the DTensors it was given
        assert isinstance(p, DTensor) and p.numel() > 0


def _dtensor_off_this_rank() -> None:
    """A DTensor on a mesh of ranks 0 and 1 only (a tp group), met on ranks 2 and 3: they
    refuse it (ranks 0 and 1 have nothing to check: wrapping there is the TP case)."""
    part = DeviceMesh("cpu", torch.tensor([0, 1]))
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), part, [Replicate()]))
    if part.get_coordinate() is None:
        with pytest.raises(ValueError, match="which this rank is not part of"):
            fsdp_lite.FSDPModule(model, mesh=_mesh()["dp"])


def _cases(rank: int, world: int) -> dict:
    results = compare_runs(_training_runs())
    results.update(run_subtests([
        ("state_dict: full plain tensors; load_state_dict", _state_dicts),
        ("summon_full_params: DTensors as before wrapping, writeback", _summon),
        ("refused: parallelize_module after wrapping", _parallelized_after_wrapping),
        ("refused: a DTensor on the dp dim", _dtensor_on_the_dp_dim),
        ("refused: a DTensor whose mesh leaves this rank out", _dtensor_off_this_rank),
    ]))  # fmt: skip
    return results


def test_tensor_parallel_dp2_tp2() -> None:
    assert_subtests_passed(run_distributed(_cases, 4, timeout=900))
