"""Randomized equivalence: FSDP training equals the single-process reference on models
and configurations nobody hand-picked.

Each case (``random_models.draw_spec``) is a random module tree (nesting depth 1-3;
Linear, Conv1d, Conv2d, LayerNorm, BatchNorm1d, Embedding layers; odd sizes; buffers,
persistent or not; an item called twice, called again later, or never called; one
module instance registered at two places; ties between parameters of the same shape,
also across would-be units; frozen parameters), a random wrapping (``by_type`` of random
classes, ``by_size`` with a random threshold, ``any_of``, none, plus random submodules
wrapped by hand) and a random configuration (mixed precision None / bf16 / fp16,
``reshard_after_forward`` None / True / False, prefetch off or ``max_in_flight`` 1-3,
CPU offload on or off, one or two micro-batches per step under ``no_sync``; about one
case in four without mixed precision loads the model in bf16 or fp16 before wrapping;
half the fp16 cases train with fsdp_lite.ShardedGradScaler beside torch.amp.GradScaler). Each trains
3 AdamW steps under ``compare_training``: losses and unsharded gradients every step,
parameters at the end, with the tolerances of ``fsdp_lite.testing.reference``. The
reference runs each rank's slice and rounds where fsdp_lite's semantics round: under
mixed precision it computes in the same dtypes, and it averages over slices in fp32
after the backward ([Note: the reference rounds where fsdp_lite does] in
random_models). A case whose tie cannot be placed (a submodule wrapped by hand shares a
parameter with something outside it) must raise fsdp_lite's tie error when wrapped.

Specs are drawn in the pytest process from ``random.Random(f"{SEED}-{case}")`` and
sent to the ranks as plain data; one spawn per world size runs all of its cases.

CI: SEED = 20240608; cases 0-199 at W=1, 200-349 at W=2, 350-424 at W=3 (425 cases, about
a minute on 2 CPU cores, to keep `make test` near 10 minutes; the full 400,300,150 set,
with 19 cases that expect the tie error, passed when this file landed). Environment
overrides: FSDP_RANDOM_SEED; FSDP_RANDOM_CASES="200,150,75" (cases at W=1,2,3);
FSDP_RANDOM_ONLY="17,42" replays those cases at every W.

Left out because of library bugs (each named where it is excluded, in random_models):
ties between a BatchNorm and another module under mixed precision ("tie across fp32
modules", now a clear error at wrap time); ties a second unit would re-flatten:
hand-wrapped siblings, or any hand-wrapped tie under an auto-wrap policy ("tie
re-flattened", now a clear error at wrap time); hand-wrapping some but
not all places of a shared module ("shared module split"). Never-called items are always
wrapped by hand: inside a flat param that gets a gradient, AdamW would decay them where
the reference (grad None) does not.
"""

from __future__ import annotations

import functools
import os
import traceback

import pytest
import random_models as rm
import torch

from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import Run, compare_training

SEED = int(os.environ.get("FSDP_RANDOM_SEED", "20240608"))
CASES = [int(n) for n in os.environ.get("FSDP_RANDOM_CASES", "200,150,75").split(",")]
STEPS = 3


def case_ids(world: int) -> list[int]:
    only = os.environ.get("FSDP_RANDOM_ONLY")
    if only:
        return [int(c) for c in only.split(",")]
    start = sum(CASES[: world - 1])
    return list(range(start, start + CASES[world - 1]))


def _run(spec: rm.Spec, world: int) -> Run:
    return Run(
        name=rm.describe(spec),
        make_model=functools.partial(rm.build_reference, spec, world),
        batch=functools.partial(rm.batch, spec, world),
        loss=rm.loss,
        wrap=functools.partial(rm.wrap_model, spec),
        tol=rm.tolerance(spec),
        steps=STEPS,
        split_reference=True,  # per-rank slices: BatchNorm statistics, and rounding
        accumulate=spec["accumulate"],
        scaler=spec["scaler"],
    )


def _check_refused(spec: rm.Spec) -> None:
    """Wrapping raises fsdp_lite's error for a tied parameter or a shared module split
    across units (not a later, obscure one)."""
    torch.manual_seed(1234)
    try:
        rm.wrap_model(spec, rm.build_model(spec))
    except ValueError as e:
        if "must live in one unit" in str(e):
            return
        raise AssertionError(f"wrong error for {spec['expect_error']} split across units") from e
    raise AssertionError(f"wrapping accepted {spec['expect_error']}, split across units")


def run_cases(rank: int, world: int, specs: list[rm.Spec]) -> dict[int, str]:
    """Every case in turn; ``{case id: what failed}``."""
    failures = {}
    for spec in specs:
        try:
            if spec["expect_error"] is not None:
                _check_refused(spec)
            else:
                compare_training(_run(spec, world))
        except Exception:  # noqa: BLE001 - run every case, report them all
            failures[spec["id"]] = f"{rm.describe(spec)}\n{traceback.format_exc(limit=-6)}"
    return failures


@pytest.mark.parametrize("world", [1, 2, 3])
def test_random_models_match_single_process_reference(world: int) -> None:
    specs = [rm.draw_spec(SEED, case) for case in case_ids(world)]
    failures: dict[int, str] = {}
    for rank, failed in enumerate(run_distributed(run_cases, world, specs, timeout=300)):
        for case, text in failed.items():
            failures.setdefault(case, f"rank {rank}, {text}")
    report = "\n".join(failures[c] for c in sorted(failures))
    assert not failures, f"{len(failures)} of {len(specs)} cases failed (seed {SEED}):\n{report}"
