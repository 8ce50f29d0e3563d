"""The freeing order's guard (see unit.py, Note "why freeing at the gradient's hook is
safe"): a backward node that reads a weight through ``W.detach()`` -- no autograd edge to
the weight, so nothing orders it before the hook that frees the full buffer -- must never
find the buffer freed, plain and under activation checkpointing, and the gradients equal
the unwrapped model's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fsdp_lite
from fsdp_lite.core.tree import unit_of


class ReadsDetachedWeight(torch.autograd.Function):
    """``x @ w.T`` whose backward reads ``w`` (given detached) for the input's gradient
    and fails if its storage was freed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (w,) = ctx.saved_tensors
        if w.untyped_storage().nbytes() == 0:
            raise AssertionError("the weight's storage was freed before a node that reads it")
        return grad @ w, None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ReadsDetachedWeight.apply(x, self.a.weight.detach()) + self.a.bias
        h = torch.tanh(h) @ self.b.weight.detach().t()  # an aten op reading it the same way
        return self.b(h) + x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), Block(), Block(), nn.Linear(16, 4))


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_detached_read_never_finds_the_weight_freed(world1, checkpointed: bool) -> None:
    ref = _model()
    model = copy.deepcopy(ref)
    if checkpointed:
        fsdp_lite.apply_activation_checkpointing(model, fsdp_lite.wrap.by_type(Block))
    policy = fsdp_lite.wrap.by_type(Block, fsdp_lite.CheckpointWrapper)
    model = fsdp_lite.FSDPModule(model, auto_wrap_policy=policy)
    units = [u for m in model.modules() if (u := unit_of(m)) is not None]
    x = torch.randn(8, 16, requires_grad=True)
    for step in range(2):  # the second runs on the recorded order, with prefetching
        x.grad = None
        model(x).square().mean().backward()
        got = x.grad.clone()
        x.grad = None
        ref(x).square().mean().backward()
        torch.testing.assert_close(got, x.grad, msg=lambda m, step=step: f"step {step}: {m}")
        # the buffers the reads saw were freed by their hooks: the reads raced them
        sizes = [f.full.untyped_storage().nbytes() for u in units for f in u.flat_params]
        assert sizes == [0, 0, 0], sizes  # 2 blocks, the root (never a freed tensor here:
        # an assertion's repr of one crashes the process)
