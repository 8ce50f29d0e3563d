"""Activation checkpointing composed with units, in either order and either variant, trains
exactly like the reference without checkpointing; recompute issues no extra reduce-scatter."""

from __future__ import annotations

import functools

import pytest
import torch
from cases import gpt, gpt_run, token_batch
from test_prefetch import _log_collectives

import fsdp_lite
from fsdp_lite import FSDPModule, apply_activation_checkpointing, checkpoint_wrapper
from fsdp_lite.addons.activation_checkpointing import CheckpointWrapper
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.models import Block
from fsdp_lite.testing.reference import compare_runs
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests


def unit_outside(module, reentrant: bool, **kwargs) -> FSDPModule:
    """FSDPModule(checkpoint_wrapper(block)) for every block."""
    wrapper = functools.partial(checkpoint_wrapper, use_reentrant=reentrant)
    apply_activation_checkpointing(module, fsdp_lite.wrap.by_type(Block), wrapper)
    return FSDPModule(module, auto_wrap_policy=fsdp_lite.wrap.by_type(CheckpointWrapper), **kwargs)


def unit_inside(module, reentrant: bool, **kwargs) -> FSDPModule:
    """checkpoint_wrapper(FSDPModule(block)) for every block."""
    model = FSDPModule(module, auto_wrap_policy=fsdp_lite.wrap.by_type(Block), **kwargs)
    wrapper = functools.partial(checkpoint_wrapper, use_reentrant=reentrant)
    is_block_unit = lambda m: isinstance(m, FSDPModule) and isinstance(m.module, Block)  # noqa: E731
    apply_activation_checkpointing(model, is_block_unit, wrapper)
    return model


COMPOSITIONS = {"unit(ckpt(block))": unit_outside, "ckpt(unit(block))": unit_inside}


def _runs(world: int) -> list:
    runs = []
    for comp_name, compose in COMPOSITIONS.items():
        for reentrant in (False, True):
            name = f"{comp_name} {'reentrant' if reentrant else 'non-reentrant'}"
            for raf in (None, True, False):
                wrap = functools.partial(compose, reentrant=reentrant, reshard_after_forward=raf)
                dropout_gpt = functools.partial(gpt, dropout=0.1)
                runs.append(
                    gpt_run(
                        name, world, raf=raf, wrap=wrap, make_model=dropout_gpt, replay_rng=True
                    )
                )
            wrap = functools.partial(compose, reentrant=reentrant)
            runs.append(gpt_run(f"{name} no_sync", world, wrap=wrap, accumulate=2))
            mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16)
            wrap = functools.partial(compose, reentrant=reentrant, mixed_precision=mp)
            runs.append(gpt_run(f"{name}", world, "bf16", wrap=wrap))
    return runs


def _collective_counts(world: int) -> None:
    """raf on: per block unit 2 gathers (forward, backward) and 1 reduce-scatter per step."""
    x, y = (t.chunk(world)[0] for t in token_batch(world, 0))
    for compose in COMPOSITIONS.values():
        for reentrant in (False, True):
            model = compose(gpt(), reentrant=reentrant, reshard_after_forward=True)
            log: list = []
            _log_collectives(log)
            for _ in range(2):
                log.clear()
                model(x, y)[1].backward()
                for i in range(2):
                    unit = f"blocks.{i}"
                    assert log.count(("AG", unit)) == 2, (compose, reentrant, log)
                    assert log.count(("RS", unit)) == 1, (compose, reentrant, log)
                assert log.count(("RS", "<root GPT>")) == 1, log
            model.state_dict()  # still consistent, every unit IDLE


def _state_dict_keys(world: int) -> None:
    want = list(gpt().state_dict())
    for compose in COMPOSITIONS.values():
        assert list(compose(gpt(), reentrant=False).state_dict()) == want
    plain = apply_activation_checkpointing(gpt(), fsdp_lite.wrap.by_type(Block))
    assert list(plain.state_dict()) == want
    plain.load_state_dict(gpt().state_dict())


def _checkpointing(rank: int, world: int) -> dict:
    results = compare_runs(_runs(world))
    results.update(
        run_subtests(
            [
                ("recompute issues no extra reduce-scatter", lambda: _collective_counts(world)),
                ("state dict keys without the wrapper", lambda: _state_dict_keys(world)),
            ]
        )
    )
    return results


@pytest.mark.parametrize("world", [1, 2])
def test_checkpointing_matches_reference_without_checkpointing(world: int) -> None:
    assert_subtests_passed(run_distributed(_checkpointing, world))
