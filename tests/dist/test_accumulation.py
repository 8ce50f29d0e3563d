"""Gradient accumulation that gathers once per step (issue 42, point 1): FSDP2's
``set_requires_gradient_sync`` / ``set_reshard_after_backward`` loop over N micro-batches
keeps every unit's full parameters from the first micro-batch's forward to the last
backward, so a step issues one all-gather per flat param (two where the unit is
resharded after forward) and one reduce-scatter per trainable flat param, whatever N.
Each case trains against a single-process reference on the same global micro-batches
(losses every step, parameters at the end) and asserts the counts (W=2, gloo, a GPT with
a unit per block, many cases in one spawn).
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import fsdp_lite
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.models import Block
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

MICRO = 4
STEPS = 2


def _flats(model: nn.Module) -> list:
    return [f for u in units_of(model) for f in u.flat_params]


def _accumulate(
    make: Callable[[], nn.Module],
    between: Callable[[nn.Module, int], None] | None = None,
    **wrap_kw,
) -> list[tuple[int, int]]:
    """Train ``STEPS`` steps of ``MICRO`` micro-batches, FSDP2's loop; compare with the
    reference; return (all-gathers, reduce-scatters) per step. ``between(model, i)`` runs
    before micro-batch i > 0 (on both models)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = make()
    model = wrap_blocks(copy.deepcopy(ref), **wrap_kw)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    counts = []
    for step in range(STEPS):
        fsdp_lite.reset_stats(model)
        got = want = 0.0
        for i in range(MICRO):
            if between is not None and i > 0:
                between(ref, i)
                between(model, i)
            last = i == MICRO - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            batch = token_batch(world, step * MICRO + i)
            loss = gpt_loss(ref, batch) / MICRO
            loss.backward()
            want += loss.item()
            mine = gpt_loss(model, local_part(batch, rank, world)) / MICRO
            mine.backward()
            got += mean_over_ranks(mine)
        collectives = fsdp_lite.stats(model)["collectives"]
        counts.append((collectives["all_gather"]["calls"], collectives["reduce_scatter"]["calls"]))
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        assert_close_loss(f"step {step}", got, want, 1e-5)
    assert all(not f.is_unsharded for f in _flats(model)), "full parameters left after the step"
    got_sd, want_sd = model.state_dict(), ref.state_dict()
    for name, value in want_sd.items():
        torch.testing.assert_close(got_sd[name], value, rtol=1e-5, atol=1e-6, msg=name)
    return counts


def _expect(counts: list[tuple[int, int]], gathers: int, reduces: int) -> None:
    assert all(c == (gathers, reduces) for c in counts), (counts, gathers, reduces)


def _layouts() -> None:
    for layout in ("flat", "pieces", "whole"):
        # 3 units (root + 2 blocks), one flat param each; the blocks reshard after forward.
        _expect(_accumulate(gpt, optimizer_params=layout), gathers=3 + 2, reduces=3)
    _expect(_accumulate(gpt, reshard_after_forward=False), gathers=3, reduces=3)


def _frozen_base() -> None:
    """Units holding a frozen and a trainable flat param (the frozen base of LoRA)."""
    torch.manual_seed(0)
    model = wrap_blocks(frozen_gpt())
    flats = _flats(model)
    trainable = sum(f.requires_grad for f in flats)
    blocks = [u for u in units_of(model) if isinstance(u.module, Block)]
    again = sum(len(u.flat_params) for u in blocks)  # resharded after forward
    _expect(_accumulate(frozen_gpt), gathers=len(flats) + again, reduces=trainable)


def _checkpointed() -> None:
    def make() -> nn.Module:
        model = gpt()
        return fsdp_lite.apply_activation_checkpointing(model, lambda m: isinstance(m, Block))

    _expect(_accumulate(make), gathers=3 + 2, reduces=3)


def _validation_and_save_between() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    path = tempfile.mkdtemp(prefix="fsdp_lite_accum_") if rank == 0 else None
    holder = [path]
    dist.broadcast_object_list(holder)

    def between(m: nn.Module, i: int) -> None:
        batch = token_batch(world, 100 + i)
        if isinstance(m, fsdp_lite.FSDPModule):
            gpt_loss(m, local_part(batch, rank, world))  # a validation forward, grad on
            fsdp_lite.save_checkpoint(os.path.join(holder[0], f"mb{i}"), m)
        else:
            gpt_loss(m, batch)

    _expect(_accumulate(gpt, between), gathers=3 + 2, reduces=3)


def _load_between_gathers_again() -> None:
    """A load between micro-batches changes the shards: the kept full parameters are
    gathered again, and the step equals the reference's (which loads the same)."""

    def between(m: nn.Module, i: int) -> None:
        if i == 2:
            with torch.no_grad():
                for p in m.parameters() if not isinstance(m, fsdp_lite.FSDPModule) else ():
                    p.mul_(0.5)
            if isinstance(m, fsdp_lite.FSDPModule):
                sd = {k: v * 0.5 for k, v in m.state_dict().items()}
                m.load_state_dict(sd)

    # 3 + 2, then state_dict() gathers each of the 3 flat params, and the forward after
    # the load gathers the 3 kept units again.
    _expect(_accumulate(gpt, between), gathers=3 + 2 + 3 + 3, reduces=3)


def _cases(rank: int, world: int) -> dict[str, str | None]:
    return run_subtests(
        [
            ("flat, pieces, whole; reshard_after_forward False", _layouts),
            ("frozen base (LoRA-like)", _frozen_base),
            ("activation checkpointing", _checkpointed),
            (
                "validation forward and checkpoint save between micro-batches",
                _validation_and_save_between,
            ),
            ("a load between micro-batches: gathered again", _load_between_gathers_again),
        ]
    )


def test_accumulation_gathers_once_per_step():
    assert_subtests_passed(run_distributed(_cases, 2))
