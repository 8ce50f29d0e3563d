"""What FSDP1 users migrate with, each case against a single-process reference trained on
the same global batch with the same seed (W=2, gloo, a small GPT with a unit per block,
many cases in one spawn, each reported by name; issue 40):

- ``param_init_fn`` receives the module while its tensors are still on meta: FSDP1's
  ``is_meta`` / ``to_empty`` / ``reset_parameters`` function, the unconditional form,
  and an in-place function all give the eager build's values; a function that leaves
  storage unwritten (``to_empty`` alone, ``no_init`` without a load) is refused at the
  first forward, naming the parameters; FSDP2's ``to_empty`` after wrapping keeps the
  values and ``model.apply(init)`` initializes through the shards;
- ``summon_full_params`` after a forward with no backward (the root keeps its full
  parameters; ``reshard_after_forward=False``), and on a plain root with ``rank0_only``;
- orig params (``optimizer_params="pieces"``): ``p.data = t`` reaches the shards,
  ``p.grad.data = t`` is what the next backward accumulates onto, the module's own
  ``named_parameters()`` inside its forward reads as unwrapped, and an optimizer built
  before wrapping trains;
- ``summon_full_params(with_grads=True)``; ``model.apply(fn)``; pure fp16
  (``fp32_masters=False`` on a ``.half()`` model) and ``.half()`` after wrapping refused;
  unfreezing a parameter frozen at wrap time; unfreezing on some ranks only raises
  DivergenceError on every rank.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_lite
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests
from tests.dist.cases import (
    assert_close_loss,
    frozen_gpt,
    gpt,
    gpt_loss,
    local_part,
    mean_over_ranks,
    token_batch,
    wrap_blocks,
)


def _rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _train(
    model: nn.Module, ref: nn.Module, opt, ref_opt, steps: int, what: str, rtol: float = 1e-5
) -> None:
    """``steps`` SGD/Adam steps of both on the same global batch; losses compared."""
    rank, world = _rank_world()
    for step in range(steps):
        batch = token_batch(world, step)
        want = gpt_loss(ref, batch)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = gpt_loss(model, local_part(batch, rank, world))
        got.backward()
        opt.step()
        opt.zero_grad()
        assert_close_loss(f"{what} step {step}", mean_over_ranks(got), want.item(), rtol)


def _same_params(model: nn.Module, ref: nn.Module, what: str, atol: float = 1e-5) -> None:
    got, want = model.state_dict(), ref.state_dict()
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for name, value in want.items():
        diff = (got[name].float() - value.float()).abs().max().item()
        assert diff <= atol, f"{what}: {name} differs from the reference by {diff:.3g}"


# -- param_init_fn on the meta device ---------------------------------------------------


def _fsdp1_init(module: nn.Module) -> None:
    if any(t.is_meta for t in module.parameters(recurse=False)):
        module.to_empty(device=torch.device("cpu"), recurse=False)
        module.reset_parameters()


def _unconditional_init(module: nn.Module) -> None:
    module.to_empty(device=torch.device("cpu"), recurse=False)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _in_place_init(module: nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _meta_gpt() -> nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        return gpt()


def _eager_pair():
    torch.manual_seed(0)
    ref = gpt()
    return ref, torch.optim.SGD(ref.parameters(), lr=0.1)


def _init_fn_forms() -> None:
    for name, fn in (("fsdp1", _fsdp1_init), ("unconditional", _unconditional_init),
                     ("in place", _in_place_init)):  # fmt: skip
        ref, ref_opt = _eager_pair()
        model = wrap_blocks(_meta_gpt(), param_init_fn=fn)
        _same_params(model, ref, f"{name}: after wrapping", atol=0)
        _train(model, ref, torch.optim.SGD(model.parameters(), lr=0.1), ref_opt, 2, name)


def _unwritten_storage_refused() -> None:
    def only_empty(module: nn.Module) -> None:
        module.to_empty(device=torch.device("cpu"), recurse=False)

    rank, world = _rank_world()
    batch = local_part(token_batch(world, 0), rank, world)
    for fn in (only_empty, fsdp_lite.deferred_init.no_init):
        model = wrap_blocks(_meta_gpt(), param_init_fn=fn)
        with pytest.raises(RuntimeError, match=r"wte\.weight.*no init wrote"):
            gpt_loss(model, batch)
    # no_init then a load: the loaded values train.
    ref, ref_opt = _eager_pair()
    model = wrap_blocks(_meta_gpt(), param_init_fn=fsdp_lite.deferred_init.no_init)
    model.load_state_dict(ref.state_dict())
    _train(model, ref, torch.optim.SGD(model.parameters(), lr=0.1), ref_opt, 2, "no_init+load")


def _to_empty_then_apply() -> None:
    """FSDP2's habit: wrap the meta model, ``to_empty``, initialize by ``apply``."""

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            with torch.no_grad():
                m.weight.copy_(torch.linspace(-0.05, 0.05, m.weight.numel()).view_as(m.weight))

    ref, ref_opt = _eager_pair()
    model = wrap_blocks(_meta_gpt())
    before = model.state_dict()
    model.to_empty(device="cpu")
    _same_params(model, ref, "to_empty after wrapping keeps the values", atol=0)
    with pytest.raises(TypeError, match=r"to_empty\(device=meta\) after wrapping"):
        model.to_empty(device="meta")
    assert before.keys() == model.state_dict().keys()
    model.apply(init)
    ref.apply(init)
    _same_params(model, ref, "apply", atol=0)
    _train(model, ref, torch.optim.SGD(model.parameters(), lr=0.1), ref_opt, 2, "apply")


# -- summon_full_params -----------------------------------------------------------------


def _summon_after_forward() -> None:
    rank, world = _rank_world()
    for raf in (None, False):
        ref, ref_opt = _eager_pair()
        model = wrap_blocks(copy.deepcopy(ref), reshard_after_forward=raf)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.no_grad():
            gpt_loss(model, local_part(token_batch(world, 0), rank, world))
        with model.summon_full_params():
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(),
                                      strict=True):  # fmt: skip
                assert torch.equal(p, q), n
        # A forward with grad, a summon in between, then its backward.
        loss = gpt_loss(model, local_part(token_batch(world, 0), rank, world))
        with model.summon_full_params(writeback=False):
            pass
        loss.backward()
        opt.step()
        opt.zero_grad()
        want = gpt_loss(ref, token_batch(world, 0))
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _same_params(model, ref, f"raf={raf}")


def _summon_plain_root_rank0_only() -> None:
    rank, _ = _rank_world()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plain = nn.Sequential(*(fsdp_lite.FSDPModule(copy.deepcopy(m)) for m in ref))
    with fsdp_lite.FSDPModule.summon_full_params(plain, writeback=False, rank0_only=True):
        if rank == 0:
            assert torch.equal(plain[0].module.weight, ref[0].weight)
            assert torch.equal(plain[1].module.bias, ref[1].bias)
        else:
            with pytest.raises(RuntimeError, match="summon_full_params"):
                plain[0].module.weight.sum()


def _summon_with_grads() -> None:
    rank, world = _rank_world()
    for layout in ("flat", "pieces"):
        ref, _ = _eager_pair()
        model = wrap_blocks(copy.deepcopy(ref), optimizer_params=layout)
        gpt_loss(ref, token_batch(world, 0)).backward()
        gpt_loss(model, local_part(token_batch(world, 0), rank, world)).backward()
        with model.summon_full_params(with_grads=True, writeback=False):
            got = {n.replace("module.", ""): p for n, p in model.named_parameters()}
            for name, q in ref.named_parameters():
                torch.testing.assert_close(got[name].grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
        for p in model.parameters():
            assert p.grad is not None and p.grad.numel() == p.numel()  # shard grads kept


# -- orig params -------------------------------------------------------------------------


def _pieces_data_writes() -> None:
    rank, world = _rank_world()
    ref, ref_opt = _eager_pair()
    model = wrap_blocks(copy.deepcopy(ref), optimizer_params="pieces")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _, p in model.named_parameters():  # every element is in one rank's piece
        p.data = p.detach() * 2
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(2)
    _same_params(model, ref, "p.data = 2 * p")
    _train(model, ref, opt, ref_opt, 1, "after p.data")
    # p.grad.data written: the next backward accumulates onto it.
    for m, batch in ((ref, token_batch(world, 1)),
                     (model, local_part(token_batch(world, 1), rank, world))):  # fmt: skip
        gpt_loss(m, batch).backward()
    for m in (model, ref):
        for p in m.parameters():
            p.grad.data = torch.full_like(p.grad, 0.01)
    for m, batch in ((ref, token_batch(world, 2)),
                     (model, local_part(token_batch(world, 2), rank, world))):  # fmt: skip
        gpt_loss(m, batch).backward()
    opt.step()
    ref_opt.step()
    _same_params(model, ref, "p.grad.data then accumulate")


def _named_parameters_in_forward() -> None:
    rank, world = _rank_world()
    model = wrap_blocks(gpt(), optimizer_params="pieces")
    seen = {}

    def record(module: nn.Module, args: tuple) -> None:
        seen.update({n: tuple(p.shape) for n, p in module.named_parameters()})

    model.module.blocks[0].mlp.fc.register_forward_pre_hook(record)
    gpt_loss(model, local_part(token_batch(world, 0), rank, world)).backward()
    fc = gpt().blocks[0].mlp.fc
    assert seen == {n: tuple(p.shape) for n, p in fc.named_parameters()}, seen
    assert list(model.module.blocks[0].mlp.fc.named_parameters()) == []  # between steps


def _optimizer_before_wrapping() -> None:
    ref, ref_opt = _eager_pair()
    module = copy.deepcopy(ref)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    model = wrap_blocks(module, use_orig_params=True)
    _train(model, ref, opt, ref_opt, 2, "optimizer before wrapping")
    _same_params(model, ref, "optimizer before wrapping")
    flat_module = copy.deepcopy(ref)
    flat_opt = torch.optim.SGD(flat_module.parameters(), lr=0.1)
    flat = wrap_blocks(flat_module)
    rank, world = _rank_world()
    gpt_loss(flat, local_part(token_batch(world, 0), rank, world)).backward()
    with pytest.raises(RuntimeError, match="Build the optimizer after wrapping"):
        flat_opt.step()


def _unfreeze_frozen_at_wrap() -> None:
    for layout in ("flat", "pieces"):
        torch.manual_seed(0)
        ref = frozen_gpt()
        model = wrap_blocks(copy.deepcopy(ref), optimizer_params=layout)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train(model, ref, opt, ref_opt, 1, f"{layout} frozen")
        for m in (ref, model):
            m.requires_grad_(True)
        _train(model, ref, opt, ref_opt, 2, f"{layout} unfrozen")
        _same_params(model, ref, f"{layout} unfrozen")


def _unfrozen_on_some_ranks_only() -> None:
    """A parameter unfrozen on rank 0 only (as where only some ranks hold a piece of it):
    every rank raises DivergenceError instead of hanging. Last: it leaves the group's
    iteration unfinished."""
    rank, world = _rank_world()
    torch.manual_seed(0)
    model = wrap_blocks(frozen_gpt(), optimizer_params="pieces")
    batch = local_part(token_batch(world, 0), rank, world)
    gpt_loss(model, batch).backward()
    if rank == 0:
        dict(model.named_parameters())["wpe.weight"].requires_grad_(True)
    with pytest.raises(fsdp_lite.DivergenceError):
        gpt_loss(model, batch).backward()


# -- pure fp16 ----------------------------------------------------------------------------


def _pure_fp16() -> None:
    torch.manual_seed(0)
    ref = gpt().half()
    model = wrap_blocks(copy.deepcopy(ref), fp32_masters=False)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, ref, opt, ref_opt, 2, "pure fp16", rtol=2e-3)
    assert all(p.grad is None or p.grad.dtype == torch.float16 for p in model.parameters())
    _same_params(model, ref, "pure fp16", atol=2e-3)
    with pytest.raises(TypeError, match="fp32_masters=False"):
        wrap_blocks(gpt()).half()
    model.half()  # already fp16: nothing to cast


def _cases(rank: int, world: int) -> dict[str, str | None]:
    cases: list[tuple[str, Callable[[], None]]] = [
        ("param_init_fn: FSDP1, unconditional and in-place forms", _init_fn_forms),
        ("param_init_fn: unwritten storage refused", _unwritten_storage_refused),
        ("to_empty after wrapping, then apply(init)", _to_empty_then_apply),
        ("summon after a forward without backward", _summon_after_forward),
        ("summon on a plain root, rank0_only", _summon_plain_root_rank0_only),
        ("summon with_grads", _summon_with_grads),
        ("pieces: p.data and p.grad.data writes", _pieces_data_writes),
        ("pieces: named_parameters inside forward", _named_parameters_in_forward),
        ("optimizer built before wrapping", _optimizer_before_wrapping),
        ("unfreeze parameters frozen at wrap time", _unfreeze_frozen_at_wrap),
        ("pure fp16", _pure_fp16),
        ("unfrozen on some ranks only: DivergenceError", _unfrozen_on_some_ranks_only),
    ]
    return run_subtests(cases)


def test_from_fsdp1():
    assert_subtests_passed(run_distributed(_cases, 2))
