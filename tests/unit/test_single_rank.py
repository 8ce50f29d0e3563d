"""World size 1 in-process: no communication, same results as the unwrapped module;
the wrap policies pick the modules they say."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fsdp_lite
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import GPT, GPTConfig
from fsdp_lite.testing.models import Block


def test_world_size_one_matches_plain_module_without_communication(world1) -> None:
    torch.manual_seed(0)
    ref = GPT(GPTConfig())
    model = fsdp_lite.FSDPModule(copy.deepcopy(ref), auto_wrap_policy=fsdp_lite.wrap.by_type(Block))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    fsdp_lite.reset_stats(model)
    for step in range(3):
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x, x)[1].backward()
            o.step()
            o.zero_grad()
    assert fsdp_lite.stats(model)["collectives"] == {}
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)


def test_policies_choose_units(world1) -> None:
    gpt = GPT(GPTConfig(n_layer=2))
    policy = fsdp_lite.wrap.any_of(fsdp_lite.wrap.by_type(Block), fsdp_lite.wrap.by_size(8000))
    model = fsdp_lite.FSDPModule(gpt, auto_wrap_policy=policy)
    units = {name for name, m in model.named_modules() if isinstance(m, fsdp_lite.FSDPModule)}
    # blocks by type; by size: mlp (8352 params) yes, attn (4224) and wte (2048) no. Names
    # are the unwrapped model's (FSDPModule.named_modules steps over its wrappers).
    assert units == {"", "blocks.0", "blocks.1", "blocks.0.mlp", "blocks.1.mlp"}, units
    assert all(isinstance(model.get_submodule(n), torch.nn.Module) for n in units)
    shards = list(model.parameters())
    assert all(p.dim() == 1 and p.dtype == torch.float32 for p in shards)
    n_orig = sum(p.numel() for p in GPT(GPTConfig(n_layer=2)).parameters())
    assert sum(p.numel() for p in shards) == n_orig  # W=1: no padding, each tensor once


def test_state_check_message() -> None:
    from fsdp_lite.core.state import FSDPStateError, TrainingState, check_state

    check_state("u", TrainingState.IDLE, TrainingState.IDLE, doing="x")
    try:
        check_state(
            "blocks.0",
            TrainingState.FORWARD,
            TrainingState.IDLE,
            TrainingState.PRE_BACKWARD,
            doing="run forward",
        )
    except FSDPStateError as e:
        assert str(e) == (
            "fsdp_lite unit 'blocks.0' cannot run forward: it is in state FORWARD, "
            "expected IDLE or PRE_BACKWARD"
        )
    else:
        raise AssertionError("no error")


def test_buffers_and_frozen_params_not_in_optimizer(world1) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    unit = fsdp_lite.FSDPModule(model)
    flags = sorted(p.requires_grad for p in unit.parameters())
    assert flags == [False, True]  # one frozen flat param, one trainable
    unit(torch.randn(5, 3)).sum().backward()
    frozen = [p for p in unit.parameters() if not p.requires_grad][0]
    assert frozen.grad is None


def test_deleted_model_is_freed_after_training(world1) -> None:
    """Hooks autograd holds from C++ must not keep a unit (and its memory) alive."""
    import gc
    import weakref

    model = fsdp_lite.FSDPModule(GPT(GPTConfig()), auto_wrap_policy=fsdp_lite.wrap.by_type(Block))
    x = torch.randint(0, 64, (2, 16))
    model(x, x)[1].backward()
    refs = [weakref.ref(m) for m in model.modules()]
    del model
    gc.collect()
    assert all(r() is None for r in refs)


def test_size_policy_never_wraps_containers(world1) -> None:
    """ModuleList/ModuleDict have no forward: a loop over blocks must still work."""
    gpt = GPT(GPTConfig(n_layer=2))
    model = fsdp_lite.FSDPModule(gpt, auto_wrap_policy=fsdp_lite.wrap.by_size(5000))
    assert not isinstance(model.module.blocks, fsdp_lite.FSDPModule)
    x = torch.randint(0, 64, (2, 16))
    model(x, x)[1].backward()


def test_stats_are_per_model(world1) -> None:
    """Units wrapped by hand count in their root's ledger from its first forward on; a
    second model counts apart; a module with no unit is refused, saying what to pass."""
    torch.manual_seed(0)
    inner = fsdp_lite.FSDPModule(nn.Linear(8, 8))
    model = fsdp_lite.FSDPModule(nn.Sequential(inner, nn.ReLU(), nn.Linear(8, 2)))
    other = fsdp_lite.FSDPModule(nn.Linear(8, 2))
    assert units_of(inner)[0].tag.ledger is not units_of(model)[0].tag.ledger
    for m in (model, other):
        fsdp_lite.reset_stats(m)
    model(torch.randn(4, 8)).sum().backward()
    assert len({id(u.tag.ledger) for u in units_of(model)}) == 1
    # Both units held full parameters at once in forward (the root keeps its own).
    assert fsdp_lite.stats(model)["unsharded_units_peak"] == 2
    assert fsdp_lite.stats(model)["full_bytes_now"] == 0
    assert fsdp_lite.stats(other)["full_bytes_peak"] == 0
    with pytest.raises(ValueError, match="holds no FSDPModule: pass the wrapped model"):
        fsdp_lite.stats(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"takes the wrapped model, fsdp_lite.reset_stats\(model\)"):
        fsdp_lite.reset_stats()
