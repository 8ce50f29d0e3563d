"""FSDP training equals a single-process reference on the global batch: GPT and ConvNet,
W = 1, 2, 3, fp32 / bf16 / fp16, reshard_after_forward default (None), on and off."""

from __future__ import annotations

import pytest
from cases import convnet_run, gpt_run

from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import compare_training


def _matrix(rank: int, world: int) -> dict:
    results = {}
    for precision in ("fp32", "bf16", "fp16"):
        for raf in (None, True, False):
            for run in (gpt_run("gpt", world, precision, raf), convnet_run(world, precision, raf)):
                compare_training(run)
                results[run.name] = run.results
    return results


@pytest.mark.parametrize("world", [1, 2, 3])
def test_training_matches_single_process_reference(world: int) -> None:
    results = run_distributed(_matrix, world)
    print(results[0])
