"""Training features, each against the single-process reference: no_sync, clipping,
frozen parameters, a unit called twice, two forwards per backward, eval/no_grad
forwards between steps, tied weights across units, wrapping by hand."""

from __future__ import annotations

import functools

import pytest
import torch
from cases import (
    TwiceCalled,
    cross_tied_gpt,
    frozen_gpt,
    gpt,
    gpt_run,
    shared_block_gpt,
    token_batch,
    two_forwards_loss,
    wrap_blocks,
    wrap_by_hand,
)

from fsdp_lite.core.state import TrainingState
from fsdp_lite.core.tree import unit_of, units_of
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import compare_runs
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests


def _assert_resharded(model) -> None:
    for unit in units_of(model):
        assert unit.state is TrainingState.IDLE, unit.name
        for flat in unit.flat_params:
            assert not flat.is_unsharded, f"{unit.name} kept its full params"


def _eval_between_steps(model, ref, step: int) -> None:
    """eval + no_grad forward, then a grad-enabled forward with no backward."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    x, y = (t.chunk(world)[rank] for t in token_batch(world, 1000 + step))
    model.eval()
    ref.eval()
    with torch.no_grad():
        got, want = model(x)[0], ref(x)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _assert_resharded(model)
    model.train()
    ref.train()
    model(x, y)  # builds a graph nobody backpropagates through


def _features(rank: int, world: int) -> dict:
    runs = []
    for raf in (None, True, False):
        runs += [
            gpt_run("no_sync x2", world, raf=raf, accumulate=2),
            gpt_run("frozen params", world, raf=raf, make_model=frozen_gpt),
            gpt_run("called twice", world, raf=raf, make_model=TwiceCalled),
            gpt_run(
                "two forwards",
                world,
                raf=raf,
                batch=functools.partial(token_batch, world, per_rank=4),
                loss=two_forwards_loss,
            ),
            gpt_run("eval between", world, raf=raf, between_steps=_eval_between_steps),
        ]
    # Two backwards that each sync, one optimizer step: the second adds to shard grads the
    # first made, while its own backward runs (and, with pieces, to their folded grads).
    pieces = functools.partial(wrap_blocks, optimizer_params="pieces")
    runs += [
        gpt_run("2 syncs per step", world, accumulate=2, no_sync=False),
        gpt_run("2 syncs per step, pieces", world, accumulate=2, no_sync=False, wrap=pieces),
        gpt_run("2 syncs per step", world, "bf16", accumulate=2, no_sync=False),
    ]
    runs += [
        gpt_run("no_sync x2", world, "bf16", accumulate=2),
        gpt_run("clip 2", world, clip=0.05),
        gpt_run("clip inf", world, clip=0.002, clip_norm_type=float("inf")),
        gpt_run("clip 2 bf16", world, "bf16", clip=0.05),
        gpt_run("tie across units", world, make_model=cross_tied_gpt),
        gpt_run("block shared by two positions", world, make_model=shared_block_gpt),
        gpt_run("untied", world, make_model=functools.partial(gpt, tie_weights=False)),
        gpt_run("by hand", world, wrap=wrap_by_hand),
        gpt_run(
            "by hand",
            world,
            raf=False,
            wrap=functools.partial(wrap_by_hand, reshard_after_forward=False),
        ),
    ]
    results = compare_runs(runs)
    results.update(run_subtests([("tie across units: owner", lambda: _check_tie_owner(world))]))
    return results


def _check_tie_owner(world: int) -> None:
    model = wrap_blocks(cross_tied_gpt())
    owned_by_root = {s.name for f in model._unit.flat_params for s in f.slots}
    assert "blocks.0.mlp.fc.weight" in owned_by_root, owned_by_root
    for block in model.module.blocks:
        names = {s.name for f in unit_of(block).flat_params for s in f.slots}
        assert "mlp.fc.weight" not in names or block is model.module.blocks[1], names


@pytest.mark.parametrize("world", [2, 3])
def test_features_match_single_process_reference(world: int) -> None:
    assert_subtests_passed(run_distributed(_features, world))
