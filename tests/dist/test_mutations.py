"""The reference comparison must be able to fail: known-bad mutations of the gradient
path, injected one at a time inside the ranks, are each reported by ``compare_training``
(it raises its AssertionError), in fp32 and in bf16 mixed precision, while the same runs
unmutated pass (issue 15).

Each mutation patches one seam with a context manager that restores it, and counts
its applications: a mutation that never fires fails its case (the seam moved), rather
than passing as "caught". Mutations:

- divisor: the reduce-scatter input scaled so the average is over W+1, or not divided
  (x W), or divided twice (/ W); also on the low-precision path (reduce_dtype bf16 or
  fp16), which divides the full gradient *before* the reduce.
- dropped unit: one unit's reduced shard grad never added.
- frozen mix: the reduce-scatter skipped for the trainable flat param of a unit that
  also holds a frozen one.
- reduce dtype ignored: reduced in bf16 although reduce_dtype=fp32 was asked. On a GPT
  this is one bf16 rounding of a sum (2^-9 relative, far below what an fp32 reference
  can resolve), so it is tested on ``Cancel``, a model whose per-rank gradients cancel:
  see its docstring for the figures. (fp32 runs have nothing to ignore.)
- overwrite: a shard grad overwritten instead of accumulated (two reduce-scatters per
  step: two micro-batches without no_sync); no_sync's fp32 accumulator dropped.

Every case of one world size runs in one spawn, reported by name (``run_subtests``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
import torch
from cases import frozen_gpt, gpt_run, wrap_blocks
from torch import nn

import fsdp_lite
from fsdp_lite.core import collectives
from fsdp_lite.core import reduce as reduce_module
from fsdp_lite.core.flat_param import FlatParam
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import BF16, FP16, Run, Tolerance, compare_training
from fsdp_lite.testing.subtests import assert_subtests_passed, one_line, run_subtests

Mutation = Callable[[], contextlib.AbstractContextManager[list]]

# -- mutations ------------------------------------------------------------------------


@contextlib.contextmanager
def scaled_reduce(factor: Callable[[int], float]) -> Iterator[list]:
    """Scale every reduce-scatter's input by ``factor(W)``: an average over the wrong
    number of ranks, whichever side of the collective the division sits on."""
    hits: list = []
    original = collectives.reduce_scatter_flat

    def mutant(output, full, group, **kw):
        hits.append(1)
        return original(output, full * factor(collectives.world_size(group)), group, **kw)

    with mock.patch.object(collectives, "reduce_scatter_flat", mutant):
        yield hits


@contextlib.contextmanager
def patched_accumulate(skip: Callable[[FlatParam], bool], overwrite: bool) -> Iterator[list]:
    """Where a reduced shard grad lands: skip it for some flat params, or overwrite."""
    hits: list = []
    original = FlatParam.accumulate

    def mutant(flat, grad):
        if skip(flat):
            hits.append(1)
            return None
        if overwrite and flat.shard.grad is not None:
            hits.append(1)
            flat.shard.grad.copy_(grad)
            return None
        return original(flat, grad)

    with mock.patch.object(FlatParam, "accumulate", mutant):
        yield hits


# ids of the trainable flat params of units that also hold a frozen one (see mixed_units)
_MIXED: set[int] = set()


def mixed_units(model: nn.Module, ref: nn.Module) -> None:
    """``Run.before_training``: note the trainable flats of frozen/trainable units."""
    _MIXED.clear()
    for unit in units_of(model):
        if len({f.requires_grad for f in unit.flat_params}) == 2:
            _MIXED.update(id(f) for f in unit.flat_params if f.requires_grad)
    if not _MIXED:
        raise AssertionError("no unit mixes frozen and trainable flat params")


@contextlib.contextmanager
def patched_reduce(reduce: Callable, on: Callable[[FlatParam], bool]) -> Iterator[list]:
    """Replace ``reduce.reduce_scatter`` by ``reduce(original, flat, dtype)`` for the flat
    params ``on`` selects."""
    hits: list = []
    original = reduce_module.reduce_scatter

    def mutant(flat, reduce_dtype, stream=None):
        if not on(flat):
            return original(flat, reduce_dtype, stream)
        hits.append(1)
        return reduce(functools.partial(original, stream=stream), flat, reduce_dtype)

    with mock.patch.object(reduce_module, "reduce_scatter", mutant):
        yield hits


def _skip_reduce(original, flat, dtype):
    flat.take_grad()  # the gradient is consumed and never reduced
    return None


def _reduce_in_param_dtype(original, flat, dtype):
    return original(flat, flat.compute_dtype)


@contextlib.contextmanager
def dropped_no_sync() -> Iterator[list]:
    """no_sync's fp32 accumulator thrown away instead of added at the next backward."""
    hits: list = []
    original = FlatParam.take_grad

    def mutant(self):
        if self.unsharded_grad is not None:
            hits.append(1)
            self.unsharded_grad = None
        return original(self)

    with mock.patch.object(FlatParam, "take_grad", mutant):
        yield hits


MUTATIONS: dict[str, Mutation] = {
    "divisor W+1": functools.partial(scaled_reduce, lambda w: w / (w + 1)),
    "no division": functools.partial(scaled_reduce, lambda w: float(w)),
    "double division": functools.partial(scaled_reduce, lambda w: 1.0 / w),
    "unit blocks.1 dropped": functools.partial(
        patched_accumulate, lambda f: (f.tag.name or "").endswith("blocks.1"), False
    ),
    "frozen mix: trainable flat not reduced": functools.partial(
        patched_reduce, _skip_reduce, lambda f: id(f) in _MIXED
    ),
    "reduce dtype ignored": functools.partial(
        patched_reduce, _reduce_in_param_dtype, lambda f: True
    ),
    "shard grad overwritten": functools.partial(patched_accumulate, lambda f: False, True),
    "no_sync grad dropped": dropped_no_sync,
}

# -- a model where a bf16 reduce is visible ---------------------------------------------


class Cancel(nn.Module):
    """``loss = mean(x . w)``: the gradient is the batch mean of ``x``, and each rank's
    (one sample) is exact in bf16. Feature j holds, across the ranks, permutation j of
    ``VALUES[W]``: at W=3, 1 + 2^-10 - 1, whose bf16 running sum loses the 2^-10 unless
    it comes last, so whatever order the collective sums in, most features reduce to 0
    instead of 2^-10/3 (a gradient error near 1). At W=2 two addends cannot cancel
    (Sterbenz): 1 + 3*2^-10 rounds to 1, an error of 2.9e-3 that only a reference exact
    to ~1e-7 resolves: this one is (the forward runs in fp32 on bf16-exact values).
    """

    VALUES = {2: (1.0, 3 * 2.0**-10), 3: (1.0, 2.0**-10, -1.0)}

    def __init__(self) -> None:
        super().__init__()
        world = torch.distributed.get_world_size()
        features = len(list(itertools.permutations(self.VALUES[world])))
        self.weight = nn.Parameter(torch.full((features,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * self.weight.float()).sum(-1)


def cancel_batch(world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    perms = list(itertools.permutations(Cancel.VALUES[world]))
    x = torch.tensor([[p[r] for p in perms] for r in range(world)])  # (W, features)
    return x, torch.zeros(world)


def cancel_loss(model: nn.Module, batch) -> torch.Tensor:
    return model(batch[0]).mean()


# Correct runs of Cancel, measured: W=2 exact (grad, update and loss errors 0); W=3 grad
# 2.5e-5 (the fp32 reference's own sum order), update 0. A bf16 reduce: 2.9e-3 at W=2,
# 0.91 at W=3.
CANCEL_TOL = Tolerance(loss_rtol=1e-6, update_rtol=1e-6, grad_rtol=1e-4)


# -- the runs -----------------------------------------------------------------------------

STEPS = 2


def _gpt(world: int, precision: str, **kw) -> Run:
    name = " ".join(filter(None, ("gpt", kw.pop("tag", None))))
    return gpt_run(name, world, precision, steps=STEPS, **kw)


def _low_precision_reduce(world: int, dtype: torch.dtype) -> Run:
    """The path that divides the full gradient by W before a low-precision reduce."""
    mp = fsdp_lite.MixedPrecision(param_dtype=dtype, reduce_dtype=dtype)
    run = _gpt(world, "fp32", wrap=functools.partial(wrap_blocks, mixed_precision=mp))
    name = str(dtype).removeprefix("torch.")
    run.name = f"gpt W={world} {name} reduce {name}"
    run.tol = BF16 if dtype == torch.bfloat16 else FP16
    return run


def _cancel(world: int) -> Run:
    mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return Run(
        name=f"cancel W={world} bf16 reduce fp32",
        make_model=Cancel,
        batch=functools.partial(cancel_batch, world),
        loss=cancel_loss,
        wrap=functools.partial(fsdp_lite.FSDPModule, mixed_precision=mp),
        tol=CANCEL_TOL,
        steps=1,
    )


def plan(world: int) -> list[tuple[str, Callable[[], Run], list[str]]]:
    """(run name, run factory, mutations it must report); W=3 repeats the divisor cases."""
    out = []
    for prec in ("fp32", "bf16"):
        out.append((f"gpt {prec}", functools.partial(_gpt, world, prec), ["divisor W+1"]))
        out[-1][2].extend([] if world == 3 else ["no division", "unit blocks.1 dropped"])
        if world == 2:
            frozen = functools.partial(
                _gpt, world, prec, tag="frozen", make_model=frozen_gpt, before_training=mixed_units
            )
            twice = functools.partial(_gpt, world, prec, tag="2 syncs", accumulate=2, no_sync=False)
            no_sync = functools.partial(_gpt, world, prec, tag="no_sync", accumulate=2)
            out.append((f"frozen gpt {prec}", frozen, ["frozen mix: trainable flat not reduced"]))
            out.append((f"2 backwards per step {prec}", twice, ["shard grad overwritten"]))
            out.append((f"no_sync x2 {prec}", no_sync, ["no_sync grad dropped"]))
    divisors = ["divisor W+1", "no division", "double division"]
    for dtype in (torch.bfloat16, torch.float16):
        name = f"gpt reduce {str(dtype).removeprefix('torch.')}"
        out.append((name, functools.partial(_low_precision_reduce, world, dtype), divisors))
    out.append(("cancel bf16", functools.partial(_cancel, world), ["reduce dtype ignored"]))
    return out


# -- the cases ----------------------------------------------------------------------------


def _passes(make: Callable[[], Run], report: dict) -> Callable[[], None]:
    def case() -> None:
        run = make()
        compare_training(run)
        report[run.name] = {k: f"{v:.3g}" for k, v in run.results.items()}

    return case


def _caught(make: Callable[[], Run], mutation: str, report: dict) -> Callable[[], None]:
    def case() -> None:
        run = make()
        with MUTATIONS[mutation]() as hits:
            try:
                compare_training(run)
            except AssertionError as exc:
                if not hits:
                    raise AssertionError(
                        f"{mutation}: never applied (has the seam moved?)"
                    ) from exc
                report[f"{run.name} + {mutation}"] = one_line(exc)
                return
        applied = f"applied {len(hits)} times" if hits else "never applied"
        raise AssertionError(f"{mutation} ({applied}) passed the comparison: {run.results}")

    return case


def _mutations(rank: int, world: int) -> tuple[dict, dict]:
    report: dict[str, object] = {}
    cases = []
    for name, make, mutations in plan(world):
        cases.append((f"{name} W={world} unmutated passes", _passes(make, report)))
        for mutation in mutations:
            cases.append((f"{name} W={world} reports {mutation}", _caught(make, mutation, report)))
    return run_subtests(cases), report


@pytest.mark.parametrize("world", [2, 3])
def test_reference_comparison_reports_each_mutation(world: int) -> None:
    per_rank = run_distributed(_mutations, world)
    for name, what in per_rank[0][1].items():
        print(f"{name}: {what}")
    assert_subtests_passed([results for results, _ in per_rank])
