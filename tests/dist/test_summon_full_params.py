"""summon_full_params: inside, the unwrapped model's parameters (names, shapes, fp32
values) as real nn.Parameters; edits persist with writeback and only then; the state
is SUMMON_FULL_PARAMS inside and IDLE after; memory is back to the shards after."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from cases import cross_tied_gpt, gpt, token_batch, wrap_blocks
from ckpt_cases import assert_state_dicts

from fsdp_lite import FSDPStateError, MixedPrecision, TrainingState
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import run_distributed


def _clean(name: str) -> str:
    """Wrapper levels show up as 'module.' segments (FSDPModule wraps by attribute)."""
    return name.replace("module.", "")


def _check_inside(model, ref, what: str) -> None:
    got = [(_clean(n), p) for n, p in model.named_parameters()]
    want = list(ref.named_parameters())
    assert [n for n, _ in got] == [n for n, _ in want], (what, [n for n, _ in got])
    for (name, p), (_, q) in zip(got, want, strict=True):
        assert type(p) is torch.nn.Parameter and p.dtype == torch.float32, (what, name)
        assert p.requires_grad == q.requires_grad, (what, name)
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"{what} {name}")
    for unit in units_of(model):
        assert unit.state is TrainingState.SUMMON_FULL_PARAMS, unit.name


def _edit(model_or_ref) -> None:
    """An edit made through named_parameters (tied weights edited once, as in the ref)."""
    with torch.no_grad():
        for i, (_, p) in enumerate(model_or_ref.named_parameters()):
            p.mul_(0.9).add_(1e-3 * (i % 7))


def _forward_matches(model, ref, rank: int, world: int, low_precision: bool) -> None:
    x, y = (t.chunk(world)[rank] for t in token_batch(world, 0))
    with torch.no_grad():
        got, want = model(x, y)[0].float(), ref(x, y)[0]
    err = ((got - want).norm() / want.norm()).item()
    assert err < (2e-2 if low_precision else 1e-5), f"forward after summon: relative error {err}"


def _summon(rank: int, world: int) -> None:
    for make, mp in ((gpt, None), (cross_tied_gpt, None), (gpt, MixedPrecision(torch.bfloat16))):
        torch.manual_seed(0)
        ref = make()
        model = wrap_blocks(copy.deepcopy(ref), mixed_precision=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        shards = [p for p in model.parameters()]
        with model.summon_full_params():
            _check_inside(model, ref, "writeback")
            _edit(model)
            watched = weakref.ref(next(model.named_parameters())[1])
        _edit(ref)
        gc.collect()
        assert watched() is None, "a summoned parameter outlived the context"
        assert all(u.state is TrainingState.IDLE for u in units_of(model))
        assert all(not f.is_unsharded for u in units_of(model) for f in u.flat_params)
        assert [p for p in model.parameters()] == shards  # shards kept identity
        assert_state_dicts(model.state_dict(), ref.state_dict(), what="after writeback")
        _forward_matches(model, ref, rank, world, low_precision=mp is not None)
        with model.summon_full_params(writeback=False, offload_to_cpu=True):
            _check_inside(model, ref, "no writeback")
            assert all(p.device.type == "cpu" for p in model.parameters())
            _edit(model)
        assert_state_dicts(model.state_dict(), ref.state_dict(), what="after no writeback")
        opt.zero_grad()
    _options(rank, world)


def _options(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = gpt()
    model = wrap_blocks(copy.deepcopy(ref))
    with model.summon_full_params(writeback=False, rank0_only=True):
        if rank == 0:
            _check_inside(model, ref, "rank0_only")
        else:  # other ranks: the module as it was, only shards
            assert all(p.dim() == 1 for p in model.parameters())
    with pytest.raises(ValueError, match="rank0_only=True, writeback=True"):
        with model.summon_full_params(rank0_only=True):
            pass
    with model.summon_full_params(recurse=False):  # the root's own parameters only
        names = [_clean(n) for n, p in model.named_parameters() if p.dim() > 1 or "flat" not in n]
        assert names[:2] == ["wte.weight", "wpe.weight"] and "ln_f.weight" in names, names
        assert model.blocks[0].training_state is TrainingState.IDLE
        with torch.no_grad():
            model.module.ln_f.weight.fill_(2.0)
    assert model.state_dict()["ln_f.weight"].eq(2.0).all()
    with model.summon_full_params():  # no forward and no nesting inside
        with pytest.raises(FSDPStateError, match="SUMMON_FULL_PARAMS"):
            model(*token_batch(world, 0))
        with pytest.raises(FSDPStateError, match="SUMMON_FULL_PARAMS"):
            with model.summon_full_params():
                pass
    before = model.state_dict()
    with pytest.raises(KeyError):  # an error inside: no writeback, back to IDLE
        with model.summon_full_params():
            _edit(model)
            raise KeyError("boom")
    assert_state_dicts(model.state_dict(), before, what="after an error inside")
    assert all(u.state is TrainingState.IDLE for u in units_of(model))


@pytest.mark.parametrize("world", [3])
def test_summon_full_params(world: int) -> None:
    run_distributed(_summon, world)
