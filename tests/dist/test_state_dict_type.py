"""Coming from FSDP1 (issue 40), W=2 gloo, in one spawn, each case against a single-process
reference GPT trained the same way (same seed, same global batch, SGD):

- ``FSDPModule.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(...))``
  (FSDP1's spelling, ``FSDP = FSDPModule``): ``model.state_dict()`` equals the reference's;
  ``rank0_only=True`` gives ``{}`` on rank 1, and loads from rank 0's dict alone;
- ``SHARDED_STATE_DICT``: ShardedTensors that ``dcp.save`` writes to a directory and that
  ``dcp.load`` + ``model.load_state_dict`` read into a freshly wrapped model with other
  values, which then holds the reference's parameters (``dcp.load`` alone changes nothing:
  the values are copies) and trains on like it;
- ``set_state_dict_type`` persists until set again, contexts nest and restore, also after an
  exception; ``LOCAL_STATE_DICT`` and mismatched arguments are refused with what to do;
- a trained wrapped model wrapped again, inside ``nn.Sequential(wrapped, head)`` and alone:
  the outer unit becomes the root, an eval forward equals the reference's, a training step
  through it and one through the old wrapper afterwards match the reference; wrapping
  ``wrapped.module``, a wrapper twice, or a wrapper whose units are not IDLE (inside
  ``summon_full_params``) is refused.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from cases import gpt, gpt_loss, token_batch, wrap_blocks
from ckpt_cases import assert_state_dicts
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)

from fsdp_lite import FSDPModule, FSDPStateError
from fsdp_lite.core.tree import unit_of, units_of
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import FP32
from fsdp_lite.testing.subtests import agree, assert_subtests_passed, run_subtests

FSDP = FSDPModule  # what FSDP1 code calls it
STEPS = 2
ATOL = FP32.param_atol


def _local(batch: tuple) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    return tuple(t.chunk(world)[rank] for t in batch)


def _step(model: nn.Module, opt, batch: tuple, loss=gpt_loss) -> None:
    loss(model, batch).backward()
    opt.step()
    opt.zero_grad()


def _trained(steps: int = STEPS) -> tuple[FSDPModule, nn.Module]:
    """A GPT wrapped per block and its single-process reference after ``steps`` SGD steps
    on the same global batches."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = gpt()
    model = wrap_blocks(copy.deepcopy(ref))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(steps):
        _step(model, opt, _local(token_batch(world, step)))
        _step(ref, ref_opt, token_batch(world, step))
    return model, ref


def _fresh() -> FSDPModule:
    torch.manual_seed(123)  # other values than the trained model's
    return wrap_blocks(gpt())


# -- FULL_STATE_DICT ------------------------------------------------------------------------


def _full_matches_reference() -> None:
    model, ref = _trained()
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        assert_state_dicts(model.state_dict(), ref.state_dict(), ATOL, "FULL_STATE_DICT")
    with FSDP.state_dict_type(model, "full"):
        assert_state_dicts(model.state_dict(), ref.state_dict(), ATOL, "'full'")
    assert_state_dicts(model.state_dict(), ref.state_dict(), ATOL, "no context")


def _full_rank0_only() -> None:
    model, ref = _trained()
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        sd = model.state_dict()
    rank0 = dist.get_rank() == 0

    def check() -> None:
        if rank0:
            assert_state_dicts(sd, ref.state_dict(), ATOL, "rank 0")
        else:
            assert sd == {}, f"rank {dist.get_rank()} got {len(sd)} keys"

    agree("rank0_only state dict", check)
    fresh = _fresh()
    with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT, config):
        fresh.load_state_dict(sd)  # rank 1 passes {}: rank 0's dict is broadcast
    assert_state_dicts(fresh.state_dict(), ref.state_dict(), ATOL, "loaded from rank 0")


# -- SHARDED_STATE_DICT ---------------------------------------------------------------------


def _sharded_through_dcp(tmp: str) -> None:
    world = dist.get_world_size()
    model, ref = _trained()
    path = os.path.join(tmp, "sharded")
    config = ShardedStateDictConfig(offload_to_cpu=True)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, config):
        sd = model.state_dict()
        assert list(sd) == list(ref.state_dict()), list(sd)
        weight = sd["blocks.0.attn.qkv.weight"]
        assert isinstance(weight, ShardedTensor), type(weight)
        assert tuple(weight.size()) == tuple(ref.blocks[0].attn.qkv.weight.shape)
        assert all(s.tensor.device.type == "cpu" for s in weight.local_shards())
        dcp.save(sd, checkpoint_id=path)

    fresh = _fresh()
    opt = torch.optim.SGD(fresh.parameters(), lr=0.1)  # built before the load: stays valid
    before = fresh.state_dict()
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=path)
    assert_state_dicts(fresh.state_dict(), before, 0.0, "dcp.load alone (copies)")
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        result = fresh.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys, result
    assert_state_dicts(fresh.state_dict(), ref.state_dict(), ATOL, "after load_state_dict")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _step(fresh, opt, _local(token_batch(world, STEPS)))
    _step(ref, ref_opt, token_batch(world, STEPS))
    assert_state_dicts(fresh.state_dict(), ref.state_dict(), ATOL, "a step after the load")


def _sharded_refuses_other_dicts() -> None:
    model, ref = _trained(steps=0)
    with FSDP.state_dict_type(model, "sharded"):
        with pytest.raises(ValueError, match=r"not a ShardedTensor.*FULL_STATE_DICT"):
            model.load_state_dict(ref.state_dict())  # a full dict: nothing loaded
        with pytest.raises(ValueError, match=r"rank0_only=True\) makes a full state dict"):
            model.state_dict(rank0_only=True)
    assert_state_dicts(model.state_dict(), ref.state_dict(), 0.0, "after the refusals")


# -- setting the type -------------------------------------------------------------------


def _persistent_and_nested() -> None:
    model, ref = _trained(steps=0)
    block = model.module.blocks[0]  # a nested unit's wrapper: set with its tree
    previous = FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
    assert previous.state_dict_type is StateDictType.FULL_STATE_DICT, previous
    for _ in range(2):
        assert isinstance(model.state_dict()["lm_head.weight"], ShardedTensor)
        assert isinstance(block.state_dict()["attn.qkv.weight"], ShardedTensor)
    got = FSDP.get_state_dict_type(model)
    assert got.state_dict_type is StateDictType.SHARDED_STATE_DICT, got
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        assert_state_dicts(model.state_dict(), ref.state_dict(), 0.0, "full inside")
        with FSDP.state_dict_type(model, "sharded"):
            assert isinstance(model.state_dict()["lm_head.weight"], ShardedTensor)
        assert_state_dicts(model.state_dict(), ref.state_dict(), 0.0, "full again")
    assert isinstance(model.state_dict()["lm_head.weight"], ShardedTensor), "set type lost"
    with pytest.raises(KeyError), FSDP.state_dict_type(model, "full"):
        raise KeyError("in the context")
    assert isinstance(model.state_dict()["lm_head.weight"], ShardedTensor), "not restored"
    FSDP.set_state_dict_type(model, "full")
    assert_state_dicts(model.state_dict(), ref.state_dict(), 0.0, "set back to full")
    assert not isinstance(block.state_dict()["attn.qkv.weight"], ShardedTensor)
    other, _ = _trained(steps=0)  # a second model is not affected
    with FSDP.state_dict_type(model, "sharded"):
        assert not isinstance(other.state_dict()["lm_head.weight"], ShardedTensor)


def _refused_arguments() -> None:
    model, _ = _trained(steps=0)
    for local in (StateDictType.LOCAL_STATE_DICT, "local"):
        with pytest.raises(ValueError, match="no LOCAL_STATE_DICT.*use StateDictType.SHARDED"):
            FSDP.set_state_dict_type(model, local)
    with pytest.raises(ValueError, match="unknown type 'fulll'.*'full', 'sharded'"):
        FSDP.set_state_dict_type(model, "fulll")
    with pytest.raises(TypeError, match="SHARDED_STATE_DICT takes a .*ShardedStateDictConfig"):
        FSDP.set_state_dict_type(model, "sharded", FullStateDictConfig())
    with pytest.raises(NotImplementedError, match="full_optim_state_dict.*save_checkpoint"):
        FSDP.set_state_dict_type(model, "full", None, FullOptimStateDictConfig())
    with pytest.raises(ValueError, match="holds no fsdp_lite.FSDPModule"):
        FSDP.set_state_dict_type(nn.Linear(2, 2), "sharded")
    got = FSDP.get_state_dict_type(model)
    assert got.state_dict_type is StateDictType.FULL_STATE_DICT, "a refusal changed the type"


# -- a wrapped model wrapped again ----------------------------------------------------------


class _Head(nn.Module):
    """Reads the logits out of the GPT's ``(logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 3)

    def forward(self, out: tuple) -> torch.Tensor:
        return self.proj(out[0])


def _head_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(batch[0]).square().mean()


def _check_root(outer: FSDPModule) -> None:
    root = unit_of(outer).root
    assert root is not None and unit_of(outer).is_root, "the outer unit is not the root"
    assert all(u.root is root for u in units_of(outer)), "a unit kept its old root"
    assert sum(u.is_root for u in units_of(outer)) == 1, "two roots in one tree"


def _eval_matches(outer: nn.Module, ref: nn.Module, what: str) -> None:
    x = token_batch(dist.get_world_size(), 9)[0]
    outer.eval()
    with torch.no_grad():
        got, want = outer(_local((x,))[0]), ref(x)
    outer.train()
    want = _local((want[0],))[0] if isinstance(want, tuple) else _local((want,))[0]
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=what)


def _rewrapped_in_sequential() -> None:
    world = dist.get_world_size()
    model, ref = _trained()
    torch.manual_seed(1)
    ref_outer = nn.Sequential(ref, _Head())
    outer = FSDPModule(nn.Sequential(model, copy.deepcopy(ref_outer[1])))
    _eval_matches(outer, ref_outer, "eval forward of the outer")
    _check_root(outer)
    opt = torch.optim.SGD(outer.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_outer.parameters(), lr=0.1)
    _step(outer, opt, _local(token_batch(world, 5)), _head_loss)
    _step(ref_outer, ref_opt, token_batch(world, 5), _head_loss)
    assert_state_dicts(outer.state_dict(), ref_outer.state_dict(), ATOL, "a step of the outer")
    # The old wrapper, used directly: a nested unit of the outer's root, run on its own.
    _step(model, opt, _local(token_batch(world, 6)))
    _step(ref, ref_opt, token_batch(world, 6))
    assert_state_dicts(outer.state_dict(), ref_outer.state_dict(), ATOL, "a step of the old")
    _check_root(outer)
    _eval_matches(outer, ref_outer, "eval forward after both")


def _rewrapped_alone() -> None:
    world = dist.get_world_size()
    model, ref = _trained()
    outer = FSDPModule(model)
    assert list(outer.parameters()) == list(model.parameters()), "the outer owns nothing"
    _eval_matches(outer, ref, "eval forward of FSDPModule(wrapped)")
    _check_root(outer)
    assert_state_dicts(outer.state_dict(), ref.state_dict(), ATOL, "outer's state dict")
    opt = torch.optim.SGD(outer.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, m in ((5, outer), (6, model)):  # the old wrapper runs the outer's hooks
        _step(m, opt, _local(token_batch(world, step)))
        _step(ref, ref_opt, token_batch(world, step))
        assert_state_dicts(outer.state_dict(), ref.state_dict(), ATOL, f"step {step}")
    _check_root(outer)


def _rewrap_refusals() -> None:
    model, _ = _trained()
    with pytest.raises(ValueError, match="GPT is already wrapped by fsdp_lite.FSDPModule"):
        FSDPModule(model.module)
    outer = FSDPModule(model)
    with pytest.raises(ValueError, match="FSDPModule is already wrapped by fsdp_lite"):
        FSDPModule(model)  # a second outer around the same wrapper
    with outer.summon_full_params(writeback=False):
        with pytest.raises(FSDPStateError, match="cannot be wrapped again.*between iterations"):
            FSDPModule(nn.Sequential(outer))
    FSDPModule(nn.Sequential(outer))  # IDLE again: allowed


def _cases(rank: int, world: int, tmp: str) -> dict:
    return run_subtests(
        [
            ("FULL_STATE_DICT equals the reference's state dict", _full_matches_reference),
            ("FULL_STATE_DICT rank0_only: {} on rank 1, loads rank 0's", _full_rank0_only),
            ("SHARDED_STATE_DICT through dcp.save / dcp.load", lambda: _sharded_through_dcp(tmp)),
            ("SHARDED_STATE_DICT refuses a full dict, rank0_only", _sharded_refuses_other_dicts),
            ("set_state_dict_type persists, contexts nest and restore", _persistent_and_nested),
            ("LOCAL_STATE_DICT and mismatched arguments refused", _refused_arguments),
            ("wrapped again inside nn.Sequential with a head", _rewrapped_in_sequential),
            ("wrapped again alone: FSDPModule(wrapped)", _rewrapped_alone),
            ("wrapping again refused: .module, twice, not IDLE", _rewrap_refusals),
        ]
    )


def test_state_dict_type_and_rewrapping(tmp_path) -> None:
    assert_subtests_passed(run_distributed(_cases, 2, str(tmp_path), timeout=240))
