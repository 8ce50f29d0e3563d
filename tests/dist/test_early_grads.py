"""A large gradient of the root reduce-scattered as soon as it is complete
(fsdp_lite/early_grads.py), against the single-process reference, at W=2 and W=3:
the tied GPT head (fp32, bf16 with an fp32 reduce, gradient accumulation under no_sync),
an untied head, HF Llama; pieces of a few KiB, so a slot spans several, some skipped.
Each case also counts the early reduce-scatters: one per step (none under no_sync)."""

from __future__ import annotations

import functools

import pytest
import torch
from cases import gpt, gpt_run
from hf_cases import hf_run, llama

from fsdp_lite import early_grads, flat_param
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests
from fsdp_lite.testing.reference import compare_training
from fsdp_lite.unit import Unit


def _runs(world: int) -> list:
    return [
        gpt_run("tied head", world),
        gpt_run("tied head", world, "bf16"),
        gpt_run("tied head no_sync x2", world, accumulate=2),
        gpt_run("untied head", world, make_model=functools.partial(gpt, tie_weights=False)),
        hf_run("llama", world, llama),
    ]


def _cases(rank: int, world: int) -> dict:
    early_grads.EARLY_REDUCE_BYTES = 4096  # the heads and embeddings; no block weight
    flat_param.WIDEN_PIECE_BYTES = 4096
    calls: list[int] = []
    original = Unit.reduce_slot_now

    def counted(self, flat, index, grad):
        calls.append(index)
        return original(self, flat, index, grad)

    Unit.reduce_slot_now = counted

    def case(run) -> None:
        calls.clear()
        compare_training(run)
        assert len(calls) == run.steps, (run.name, calls)

    return run_subtests((run.name, functools.partial(case, run)) for run in _runs(world))


@pytest.mark.parametrize("world", [2, 3])
def test_early_reduce_matches_reference(world: int) -> None:
    assert_subtests_passed(run_distributed(_cases, world, timeout=300.0))
