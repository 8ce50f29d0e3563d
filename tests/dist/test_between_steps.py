"""What users do between and around training steps trains equal to a single-process
reference or raises a named error, never a crash or a silently wrong result (W=2, gloo,
a small GPT with a unit per block, each case by name):

- reading a wrapped block's weight after a step raises an error naming
  ``summon_full_params`` (it used to be a view of freed storage: SIGSEGV);
- a validation forward with grad enabled between ``backward`` and ``opt.step()`` (or a
  step written by hand through ``p.data.add_``, which no version counter or optimizer
  hook sees): the root's kept full parameters are freed at the next forward, gathered
  again (they used to be stale);
- a unit that got a gradient in a ``no_sync`` micro-step but none in the synchronizing
  one: its gradient reaches this step (it used to reach a later one);
- ``requires_grad`` turned off and on again after wrapping (a block frozen for some
  steps), in every layout of what the optimizer sees: trains as the reference does;
- a chunked loss through the root's head outside the root's forward, tied and untied
  (FSDP2's ``test_partial_group_forward_then_standalone``; it used to raise
  FSDPStateError), and such a gradient with no backward through the output after it:
  refused at the next forward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fsdp_lite
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests
from tests.dist.cases import (
    PRECISIONS,
    assert_close_loss,
    gpt,
    gpt_loss,
    local_part,
    mean_over_ranks,
    token_batch,
    wrap_blocks,
)

STEPS = 3


def _pair(make: Callable[[], nn.Module], wrap: Callable[[nn.Module], nn.Module], lr=1e-3):
    torch.manual_seed(0)
    ref = make()
    model = wrap(copy.deepcopy(ref))
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, eps=1e-6) for m in (ref, model)]
    return ref, model, opts


def _same_params(model: nn.Module, ref: nn.Module, atol: float = 1e-5) -> None:
    got, want = model.state_dict(), ref.state_dict()
    for name, _ in ref.named_parameters():
        diff = (got[name].float() - want[name].float()).abs().max().item()
        if diff > atol:
            raise AssertionError(f"parameter {name} differs from the reference by {diff:.3g}")


# -- a parameter attribute between steps ---------------------------------------------


def _read_weight_between_steps() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model, (ref_opt, opt) = _pair(gpt, wrap_blocks)
    fc = model.module.blocks[1].mlp.fc
    with pytest.raises(RuntimeError, match="summon_full_params"):
        fc.weight.norm()  # before the first forward
    for m, o, batch in ((ref, ref_opt, token_batch(world, 0)),
                        (model, opt, local_part(token_batch(world, 0), rank, world))):  # fmt: skip
        gpt_loss(m, batch).backward()
        o.step()
    weight = fc.weight
    assert weight.shape == ref.blocks[1].mlp.fc.weight.shape
    assert weight.dtype == torch.float32 and weight.device == torch.device("cpu")
    assert weight.is_cpu and not weight.is_meta and not weight.is_cuda
    with pytest.raises(RuntimeError, match=r"\.data on parameter 'mlp\.fc\.weight'.*summon_full"):
        weight.data.normal_(0, 0.02)  # used to write into a meta tensor: nothing happened
    with pytest.raises(RuntimeError, match="summon_full_params"):
        torch.save(weight.data, "unused.pt")
    with pytest.raises(RuntimeError, match=r"norm on parameter 'mlp\.fc\.weight' of "
                       r"unit blocks\.1.*summon_full_params"):  # fmt: skip
        weight.norm()
    with pytest.raises(RuntimeError, match="summon_full_params"):
        model.module.wte.weight.sum()  # the root's, freed at the end of backward
    with model.summon_full_params():
        torch.testing.assert_close(fc.weight, ref.blocks[1].mlp.fc.weight)
    with pytest.raises(RuntimeError, match="summon_full_params"):
        fc.weight.add_(1.0)


# -- a validation forward with grad enabled before the step ----------------------------


def _sgd_through_data(model: nn.Module, lr: float = 1e-2) -> None:
    """A hand-written step: ``p.data.add_`` bumps no version counter and fires no optimizer
    hook, so nothing but the kept parameters' lifetime can keep them from going stale."""
    for p in model.parameters():
        if p.grad is not None:
            p.data.add_(p.grad, alpha=-lr)
            p.grad = None


def _validation_forward_before_step(
    precision: str, raf: bool | None, by_hand: bool = False
) -> Callable[[], None]:
    def case() -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        mp, tol = PRECISIONS[precision]
        ref, model, (ref_opt, opt) = _pair(
            gpt, lambda m: wrap_blocks(m, mixed_precision=mp, reshard_after_forward=raf)
        )
        val = token_batch(world, 99)
        for step in range(STEPS):
            batch = token_batch(world, step)
            want = gpt_loss(ref, batch)
            want.backward()
            got = gpt_loss(model, local_part(batch, rank, world))
            got.backward()
            assert_close_loss(f"step {step} loss", mean_over_ranks(got), want.item(), tol.loss_rtol)
            want = gpt_loss(ref, val)  # grad enabled, no backward
            got = gpt_loss(model, local_part(val, rank, world))
            assert_close_loss(
                f"step {step} validation loss", mean_over_ranks(got), want.item(), tol.loss_rtol
            )
            if by_hand:
                _sgd_through_data(ref), _sgd_through_data(model)
            else:
                ref_opt.step(), opt.step()
                ref_opt.zero_grad(), opt.zero_grad()
        with torch.no_grad():
            want = gpt_loss(ref, val).item()
            got = mean_over_ranks(gpt_loss(model, local_part(val, rank, world)))
        assert_close_loss("validation loss after the last step", got, want, tol.loss_rtol)
        if precision == "fp32":
            _same_params(model, ref)

    return case


# -- gradient accumulation: a unit used only in a no_sync micro-step -------------------


class Branchy(nn.Module):
    """A trunk, and two branches of which each micro-step uses one."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.a = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, branch: str) -> torch.Tensor:
        return self.head(getattr(self, branch)(self.trunk(x))).square().mean()


def _wrap_branches(m: Branchy) -> fsdp_lite.FSDPModule:
    m.a, m.b = fsdp_lite.FSDPModule(m.a), fsdp_lite.FSDPModule(m.b)
    return fsdp_lite.FSDPModule(m)


def _unit_used_only_in_no_sync() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model, (ref_opt, opt) = _pair(Branchy, _wrap_branches)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        micro = [torch.randn(4 * world, 8, generator=g) for _ in range(2)]
        for x, branch in zip(micro, ("a", "b"), strict=True):
            (ref(x, branch) / 2).backward()
        with model.no_sync():
            (model(micro[0].chunk(world)[rank], "a") / 2).backward()
        (model(micro[1].chunk(world)[rank], "b") / 2).backward()
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    _same_params(model, ref)


# -- requires_grad changed after wrapping ----------------------------------------------


def _freeze_after_wrapping() -> None:
    """Freeze a block after a step, train, unfreeze it, train: equal to the reference
    doing the same, for each layout of what the optimizer sees."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for layout in ("flat", "pieces", "whole"):
        wrap = lambda m, layout=layout: wrap_blocks(m, optimizer_params=layout)  # noqa: E731
        ref, model, (ref_opt, opt) = _pair(gpt, wrap)
        blocks = (ref.blocks[0], model.module.blocks[0])
        for step, frozen in enumerate((False, True, True, False, False)):
            for block in blocks:
                block.requires_grad_(not frozen)
            whole = token_batch(world, step)
            for m, o, batch in ((ref, ref_opt, whole),
                                (model, opt, local_part(whole, rank, world))):  # fmt: skip
                loss = gpt_loss(m, batch)
                loss.backward()
                o.step()
                o.zero_grad()
                if m is ref:
                    want = loss.item()
            assert_close_loss(f"{layout} step {step}", mean_over_ranks(loss.detach()), want, 1e-5)
        _same_params(model, ref)
    with pytest.raises(RuntimeError, match="set requires_grad on what model.parameters"):
        model.module.blocks[1].mlp.fc.weight.requires_grad_(False)


# -- a chunked loss through the root's head ---------------------------------------------


class SkipHeadGPT(nn.Module):
    """An embedding, blocks and a head that ``forward(x, skip_head=True)`` leaves out."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.wte = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, x: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.wte(x)
        for block in self.blocks:
            h = h + block(h)
        h = self.norm(h)
        return h if skip_head else self.head(h)


def _chunked_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The head and loss a chunk at a time on a detached copy of the hidden states, then
    one backward through the trunk."""
    h = model(x, skip_head=True)
    hd = h.detach().requires_grad_()
    total = 0.0
    for hc, yc in zip(hd.chunk(2, dim=1), y.chunk(2, dim=1), strict=True):
        loss = F.cross_entropy(model.head(hc).flatten(0, 1), yc.flatten()) / 2
        loss.backward()
        total += loss.item()
    h.backward(hd.grad)
    return total


def _chunked_head(tied: bool) -> Callable[[], None]:
    def case() -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        wrap = lambda m: fsdp_lite.FSDPModule(  # noqa: E731
            m, auto_wrap_policy=fsdp_lite.wrap.by_type(nn.Sequential)
        )
        ref, model, (ref_opt, opt) = _pair(lambda: SkipHeadGPT(tied), wrap)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, 32, (2 * world, 8), generator=g)
            y = torch.randint(0, 32, (2 * world, 8), generator=g)
            want = _chunked_loss(ref, x, y)
            got = _chunked_loss(model, x.chunk(world)[rank], y.chunk(world)[rank])
            assert_close_loss(f"step {step} loss", mean_over_ranks(torch.tensor(got)), want, 1e-5)
            ref_opt.step(), opt.step()
            ref_opt.zero_grad(), opt.zero_grad()
        _same_params(model, ref)

    return case


def _head_gradient_never_reduced() -> None:
    """A backward through the root's head alone, with no backward through the model's output
    after it: the next forward refuses to go on (the gradient reached no step)."""
    wrap = lambda m: fsdp_lite.FSDPModule(  # noqa: E731
        m, auto_wrap_policy=fsdp_lite.wrap.by_type(nn.Sequential)
    )
    _, model, _ = _pair(lambda: SkipHeadGPT(False), wrap)
    x = torch.randint(0, 32, (2, 8))
    h = model(x, skip_head=True).detach()
    model.head(h).sum().backward()
    with pytest.raises(RuntimeError, match=r"unit '<root SkipHeadGPT>' got a gradient in a "
                       r"backward that did not pass through its outputs"):  # fmt: skip
        model(x)
    model(x).sum().backward()  # the dropped gradient is gone: training goes on


def _cases(rank: int, world: int) -> dict:
    cases = [("read a block's weight between steps: named error", _read_weight_between_steps)]
    for precision in ("fp32", "bf16"):
        for raf in (None, False):
            cases.append((
                f"validation forward with grad before the step ({precision}, raf={raf})",
                _validation_forward_before_step(precision, raf),
            ))  # fmt: skip
    cases.append((
        "validation forward with grad, then a step through p.data.add_",
        _validation_forward_before_step("fp32", None, by_hand=True),
    ))  # fmt: skip
    cases += [
        ("a unit used only in a no_sync micro-step", _unit_used_only_in_no_sync),
        ("requires_grad changed after wrapping: followed", _freeze_after_wrapping),
        ("chunked loss through the root's head (tied)", _chunked_head(True)),
        ("chunked loss through the root's head (untied)", _chunked_head(False)),
        (
            "a head gradient never reduced: refused at the next forward",
            _head_gradient_never_reduced,
        ),
    ]
    return run_subtests(cases)


def test_between_steps() -> None:
    assert_subtests_passed(run_distributed(_cases, 2, timeout=240))
