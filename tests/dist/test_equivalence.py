"""FSDP training equals a single-process reference on the global batch: GPT and ConvNet,
W = 1, 2, 3, fp32 / bf16 / fp16, reshard_after_forward default (None), on and off."""

from __future__ import annotations

import pytest
from cases import convnet_run, gpt_run

from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import compare_runs
from fsdp_lite.testing.subtests import assert_subtests_passed


def _matrix(rank: int, world: int) -> dict:
    runs = [
        run
        for precision in ("fp32", "bf16", "fp16")
        for raf in (None, True, False)
        for run in (gpt_run("gpt", world, precision, raf), convnet_run(world, precision, raf))
    ]
    return compare_runs(runs)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_training_matches_single_process_reference(world: int) -> None:
    assert_subtests_passed(run_distributed(_matrix, world))
