"""No host synchronization in the steady-state step (W=2, gloo, bf16, a GPT with a unit
per block), counted in every workflow users run, after three warm-up steps:

- forward, backward, ``clip_grad_norm_``;
- gradient accumulation: two ``no_sync`` micro-batches, then a synchronized one;
- a ``no_grad`` evaluation forward after each step;
- two forwards, then one backward of the summed loss (DPO, contrastive, siamese);
- backward, then a validation forward with grad enabled, then clip and step;
- two micro-batches without ``no_sync``, then clip and step;
- greedy decoding: ``no_grad`` forwards of a growing sequence (``generate()``'s loop);
- two wrapped models (whole params) trained in alternation in one process;
- each of the above with ``fsdp_lite.stats(model)`` read every step.

Operations on the process group's store (the divergence check's rendezvous) are counted
beside them: none may happen either.

A host sync is an op that reads a device value on the host (``_local_scalar_dense``:
``.item()``, ``bool()`` of a tensor; ``is_nonzero``; ``equal``; ``tolist`` goes through
``_local_scalar_dense`` too), counted by a dispatch mode, plus the CUDA waits
(``torch.cuda.synchronize``, ``Event.synchronize``/``elapsed_time``), patched to count.
On a GPU each one stops the host from running ahead of the device. The optimizer's own
step is left out (a CPU AdamW reads its step count on the host).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_lite
from fsdp_lite.core import collectives
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests
from tests.dist.cases import gpt, gpt_loss, token_batch, wrap_blocks

_SYNC_OPS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal"}
# Warm-up: the first iteration records the order, the second prefetches along it (a new
# order, compared in lockstep), the third closes that check; the steady state follows.
WARMUP, COUNTED = 3, 3


class HostSyncs(TorchDispatchMode):
    """Counts ops that read a device value on the host, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _SYNC_OPS:
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_cuda_waits(seen: Counter) -> Iterator[None]:
    """``torch.cuda.synchronize`` and ``Event.synchronize``/``elapsed_time`` counted."""
    patched = [
        (torch.cuda, "synchronize"),
        (torch.cuda.Event, "synchronize"),
        (torch.cuda.Event, "elapsed_time"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]

    def counter(what: str, original: Callable) -> Callable:
        def call(*args, **kwargs):
            seen[what] += 1
            return original(*args, **kwargs)

        return call

    for owner, name, original in saved:
        setattr(owner, name, counter(f"cuda {name}", original))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@contextlib.contextmanager
def counting_store_ops(seen: Counter) -> Iterator[None]:
    """Every call on the store fsdp_lite reaches (``collectives.store``), counted."""
    original = collectives.store

    class Counted:
        def __init__(self, store) -> None:
            self._store = store

        def __getattr__(self, name: str):
            seen[f"store {name}"] += 1
            return getattr(self._store, name)

    collectives.store = lambda: Counted(original())
    try:
        yield
    finally:
        collectives.store = original


def _syncs_per_step(step: Callable[[int, HostSyncs], None], read_stats: list) -> Counter:
    """Host syncs in each counted step; ``read_stats``: models whose stats are read and
    reset after every step."""
    seen: Counter[str] = Counter()
    for i in range(WARMUP + COUNTED):
        mode = HostSyncs()
        with counting_cuda_waits(mode.seen), counting_store_ops(mode.seen):
            step(i, mode)
            with mode:
                for model in read_stats:
                    fsdp_lite.stats(model)
                    fsdp_lite.reset_stats(model)
        if i >= WARMUP:
            seen.update(mode.seen)
    return seen


def _setup():
    torch.manual_seed(0)
    mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16)
    model = wrap_blocks(gpt(n_layer=3), mixed_precision=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [tuple(t.chunk(world)[rank] for t in token_batch(world, i)) for i in range(6)]
    return model, opt, batches


def _train_clip(model, opt, batches, i: int, mode: HostSyncs) -> None:
    with mode:
        gpt_loss(model, batches[i % 6]).backward()
        model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()


def _accumulate(model, opt, batches, i: int, mode: HostSyncs) -> None:
    with mode:
        for m in range(3):
            ctx = model.no_sync() if m < 2 else contextlib.nullcontext()
            with ctx:
                (gpt_loss(model, batches[(3 * i + m) % 6]) / 3).backward()
    opt.step()
    opt.zero_grad()


def _eval_after_step(model, opt, batches, i: int, mode: HostSyncs) -> None:
    with mode:
        gpt_loss(model, batches[i % 6]).backward()
    opt.step()
    opt.zero_grad()
    with mode, torch.no_grad():
        gpt_loss(model, batches[5])


def _two_forwards(model, opt, batches, i: int, mode: HostSyncs) -> None:
    with mode:
        loss = gpt_loss(model, batches[i % 6]) + gpt_loss(model, batches[(i + 1) % 6])
        loss.backward()
        model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()


def _validation_with_grad(model, opt, batches, i: int, mode: HostSyncs) -> None:
    with mode:
        gpt_loss(model, batches[i % 6]).backward()
        gpt_loss(model, batches[5]).detach()  # a validation loss, grad enabled, no backward
        model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()


def _accumulate_without_no_sync(model, opt, batches, i: int, mode: HostSyncs) -> None:
    with mode:
        for m in range(2):
            (gpt_loss(model, batches[(2 * i + m) % 6]) / 2).backward()
        model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()


def _greedy_decode(model, opt, batches, i: int, mode: HostSyncs) -> None:
    _train_clip(model, opt, batches, i, mode)
    tokens = batches[i % 6][0][:, :4]
    with mode, torch.no_grad():
        for _ in range(4):
            logits = model(tokens)[0]
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)


def _case(workflow: Callable, read_stats: bool) -> Callable[[], None]:
    """One workflow's steps on a fresh model; no host sync once warmed up."""

    def case() -> None:
        model, opt, batches = _setup()
        step = functools.partial(workflow, model, opt, batches)
        _expect_none(_syncs_per_step(step, [model] if read_stats else []))

    return case


def _two_models_case(read_stats: bool) -> Callable[[], None]:
    """Two wrapped models with whole params in one process, stepped in alternation."""

    def case() -> None:
        pairs = []
        for _ in range(2):
            torch.manual_seed(0)
            mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16)
            model = wrap_blocks(gpt(n_layer=3), mixed_precision=mp, optimizer_params="whole")
            pairs.append((model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
        rank, world = dist.get_rank(), dist.get_world_size()
        batches = [tuple(t.chunk(world)[rank] for t in token_batch(world, i)) for i in range(6)]

        def step(i: int, mode: HostSyncs) -> None:
            for model, opt in pairs:
                _train_clip(model, opt, batches, i, mode)

        _expect_none(_syncs_per_step(step, [m for m, _ in pairs] if read_stats else []))

    return case


def _expect_none(seen: Counter) -> None:
    if seen:
        per_step = {k: v / COUNTED for k, v in seen.items()}
        raise AssertionError(f"host syncs per steady-state step: {per_step}")


def _cases(rank: int, world: int) -> dict:
    cases = []
    for read_stats in (False, True):
        extra = ", stats() every step" if read_stats else ""
        cases += [
            (f"forward, backward, clip_grad_norm_{extra}", _case(_train_clip, read_stats)),
            (
                f"2 no_sync micro-batches, then 1 synchronized{extra}",
                _case(_accumulate, read_stats),
            ),
            (
                f"a no_grad eval forward after each step{extra}",
                _case(_eval_after_step, read_stats),
            ),
            (f"two forwards, one backward{extra}", _case(_two_forwards, read_stats)),
            (
                f"a validation forward with grad before the step{extra}",
                _case(_validation_with_grad, read_stats),
            ),
            (
                f"2 micro-batches without no_sync{extra}",
                _case(_accumulate_without_no_sync, read_stats),
            ),
            (f"greedy decoding after each step{extra}", _case(_greedy_decode, read_stats)),
            (f"two models in alternation{extra}", _two_models_case(read_stats)),
        ]
    return run_subtests(cases)


def test_no_host_sync_in_the_steady_state_step() -> None:
    assert_subtests_passed(run_distributed(_cases, 2, timeout=180))
