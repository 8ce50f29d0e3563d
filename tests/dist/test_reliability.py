"""Ranks that diverge raise DivergenceError on every rank instead of hanging or training on
mismatched data; a rank that dies makes its peers raise PeerError within the timeout."""

from __future__ import annotations

import datetime
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import fsdp_lite
from fsdp_lite.addons.state_dict import full_grads
from fsdp_lite.core import collectives
from fsdp_lite.core.collectives import DivergenceError, PeerError
from fsdp_lite.testing import DistributedTestError, run_distributed


class TwoBlocks(nn.Module):
    """Two same-shaped units; ``route`` decides which run (the data-dependent control flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.b0 = nn.Linear(16, 16)
        self.b1 = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 16)
        self.route = ("b0", "b1")

    def forward(self, x):
        x = self.inp(x)
        for name in self.route:
            x = getattr(self, name)(x)
        return x.square().mean()


def _model(**kwargs) -> fsdp_lite.FSDPModule:
    torch.manual_seed(0)
    return fsdp_lite.FSDPModule(
        TwoBlocks(), auto_wrap_policy=fsdp_lite.wrap.by_type(nn.Linear), **kwargs
    )


def _steps(model, n: int) -> None:
    for _ in range(n):
        model(torch.randn(4, 8)).backward()


def _expect(error: type, needle: list[str], fn) -> str:
    with pytest.raises(error) as info:
        fn()
    for text in needle:
        assert text in str(info.value), str(info.value)
    return str(info.value)


class Chain(nn.Module):
    """Four same-shaped units between two differently shaped ones; ``skip`` names a block
    this rank leaves out (the data-dependent control flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.out = nn.Linear(16, 4)
        self.skip: int | None = None

    def forward(self, x):
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = torch.tanh(block(x))
        return self.out(x).square().mean()


def _chain(**kwargs) -> fsdp_lite.FSDPModule:
    torch.manual_seed(0)
    return fsdp_lite.FSDPModule(
        Chain(), auto_wrap_policy=fsdp_lite.wrap.by_type(nn.Linear), **kwargs
    )


BOUND_S = 15.0  # the error reaches every rank within this many seconds of the bad step


def _skip_at(rank: int, world: int, bad_step: int, out_dir: str) -> None:
    """Rank 1 leaves block 2 out at ``bad_step``: every rank raises DivergenceError naming
    the units and ranks within BOUND_S; no rank hangs or dies in the backend."""
    model = _chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(bad_step + 1):
        if step == bad_step and rank == 1:
            model.module.skip = 2
        start = time.monotonic()
        try:
            model(torch.randn(4, 8)).backward()
        except DivergenceError as e:
            assert step == bad_step, f"raised at step {step}: {e}"
            elapsed = time.monotonic() - start
            Path(out_dir, f"rank{rank}.txt").write_text(f"{elapsed:.2f}\n{e}")
            return
        opt.step()
        opt.zero_grad()
    raise AssertionError(f"rank {rank}: no DivergenceError after skipping a unit")


@pytest.mark.parametrize("bad_step", [0, 2, 7])
def test_a_rank_skipping_a_unit_raises_divergence_error_on_every_rank(bad_step: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_skip_at, 2, bad_step, tmp, timeout=60)
        for rank in range(2):
            elapsed, msg = Path(tmp, f"rank{rank}.txt").read_text().split("\n", 1)
            assert float(elapsed) < BOUND_S, (rank, elapsed)
            assert "rank 0: " in msg and "rank 1: " in msg, msg
            assert "unit 'blocks." in msg, msg
            assert f"of iteration {bad_step + 1}" in msg, msg


def _divergence_modes(rank: int, world: int) -> None:
    # Ranks feeding different-sized inputs issue the same collectives: no error, and the
    # gradient is the mean of the ranks' own means, as on one process.
    model = _chain()
    ref = Chain()
    ref.load_state_dict(model.state_dict())
    torch.manual_seed(5)
    batches = [torch.randn(n, 8) for n in (3, 7)]
    rows = lambda step, r: 2 + (step + 2 * r) % 5  # noqa: E731 - differ across ranks
    for step in range(4):
        model(batches[rank][: rows(step, rank)]).backward()
    total = sum(ref(b[: rows(s, r)]) for s in range(4) for r, b in enumerate(batches)) / 2
    total.backward()
    grads = full_grads(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    # Every rank takes the same different path (eval, a shorter pass): agreed, no error.
    with torch.no_grad():
        model(torch.randn(2, 8))
    model.module.skip = 1
    _steps(model, 2)
    model.module.skip = None
    _steps(model, 1)
    # thorough: every collective compared before it is issued, also in the steady state.
    fsdp_lite.core.divergence.set_divergence_check("thorough")
    if rank == 1:
        model.module.skip = 3
    _expect(
        DivergenceError,
        ["about to issue different collectives", "rank 1: "],
        lambda: _steps(model, 1),
    )
    fsdp_lite.core.divergence.set_divergence_check("cheap")


def test_divergence_check_modes_and_agreed_paths() -> None:
    run_distributed(_divergence_modes, 2, timeout=120)


def _dies_mid_step(rank: int, world: int, out_dir: str) -> None:
    model = _model()
    _steps(model, 2)
    if rank == 1:
        inner = model.module.b1
        inner.register_forward_pre_hook(lambda *a: os.kill(os.getpid(), signal.SIGKILL))
    start = time.monotonic()
    try:
        _steps(model, 1)
    except PeerError as e:
        Path(out_dir, "survivor.txt").write_text(f"{time.monotonic() - start:.1f}\n{e}")
        raise


def test_dead_peer_makes_survivors_raise_peer_error() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with pytest.raises(DistributedTestError) as info:
            run_distributed(_dies_mid_step, 2, tmp, timeout=30)
        report = str(info.value)
        assert "PeerError" in report and "a peer rank is gone" in report, report
        assert "ranks [1] hung or died" in report, report
        seconds = float(Path(tmp, "survivor.txt").read_text().splitlines()[0])
        assert seconds < 30, seconds


# -- NCCL semantics: a wait orders streams and never blocks the host ------------------
# On CPU, a rank's waits are patched (collectives._wait_watching_for_divergence, behind
# every Handle.wait) to behave as NCCL's do for the host: a collective its peers never
# join does not hold the host, which goes on (after a short grace, so the buffers of
# collectives that do complete are written before they are freed); or, for a rank stuck
# in a host sync, the wait blocks and never looks for a peer's check.
GRACE_S = 1.0


def _non_blocking_wait(work, group) -> None:
    try:
        work.wait(datetime.timedelta(seconds=GRACE_S))
    except RuntimeError as e:
        if str(e) != collectives._WAIT_TIMED_OUT:
            raise


def _blocked_wait(work, group) -> None:
    """Blocked until the group's timeout, then failed, as NCCL's watchdog would abort."""
    work.wait(datetime.timedelta(seconds=collectives.group_timeout(group)))


def _diverge_under_nccl_semantics(
    rank: int, world: int, waits: str, out_dir: str, swap: bool = False
) -> None:
    """Rank 1 skips block 2 at step 3 (``swap``: runs blocks 2 and 3, of the same size, in
    the other order); rank 0's waits follow ``waits``."""
    if rank == 0:
        collectives._wait_watching_for_divergence = (
            _non_blocking_wait if waits == "non-blocking" else _blocked_wait
        )
    model = _chain()
    start = time.monotonic()
    for step in range(30):
        if step == 3 and rank == 1 and swap:
            blocks = model.module.blocks
            blocks[2], blocks[3] = blocks[3], blocks[2]
        elif step == 3 and rank == 1:
            model.module.skip = 2
        if step == 3:
            start = time.monotonic()
        try:
            model(torch.randn(4, 8)).backward()
        except (DivergenceError, PeerError) as e:
            elapsed = time.monotonic() - start
            Path(out_dir, f"rank{rank}.txt").write_text(f"{type(e).__name__} {elapsed:.2f}\n{e}")
            return
    raise AssertionError(f"rank {rank}: no error after rank 1 skipped a unit")


PG_TIMEOUT_S = 12.0  # the process group's; the harness kills only after HARNESS_S
HARNESS_S = 90.0


@pytest.mark.parametrize("waits", ["non-blocking", "blocked on the host"])
def test_divergence_error_when_waits_do_not_answer(waits: str) -> None:
    """The rank that strayed raises DivergenceError naming the silent rank after half the
    group's timeout: its peer, whose waits never looked at the store (non-blocking, as
    NCCL's) or never returned (blocked on the host), did not answer. The peer's own
    collective then fails (the straying rank is gone, or the group's timeout ran out, as
    NCCL's watchdog would abort it), and its error reports what the straying rank posted:
    DivergenceError on both, naming units and ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_diverge_under_nccl_semantics, 2, waits, tmp, timeout=HARNESS_S,
                        pg_timeout=PG_TIMEOUT_S)  # fmt: skip
        reports = [Path(tmp, f"rank{r}.txt").read_text().split("\n", 1) for r in range(2)]
    (kind0, s0), (kind1, s1) = (head.split() for head, _ in reports)
    msg0, msg1 = reports[0][1], reports[1][1]
    assert kind1 == "DivergenceError" and "unit 'blocks." in msg1, msg1
    assert "ranks [0] did not reach that point within 6 s" in msg1, msg1
    assert kind0 == "DivergenceError", msg0
    assert "rank 0: " in msg0 and "rank 1: " in msg0 and "unit 'blocks." in msg0, msg0
    assert float(s1) <= float(s0), (s1, s0)  # the peer's error comes from the straying one's


def test_same_sized_units_swapped_raise_under_nccl_semantics() -> None:
    """Two blocks of the same size run in the other order on one rank: gathers of different
    units would pair and mix shards silently. The rank that strayed raises DivergenceError
    naming the silent peer; the peer's collective then fails and its DivergenceError names
    both ranks' entries at the first collective that differs (prefetching follows the
    recorded order, so that can come after the swapped blocks' own gathers)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_diverge_under_nccl_semantics, 2, "non-blocking", tmp, True,
                        timeout=HARNESS_S, pg_timeout=PG_TIMEOUT_S)  # fmt: skip
        reports = [Path(tmp, f"rank{r}.txt").read_text().split("\n", 1) for r in range(2)]
    for head, msg in reports:
        assert head.startswith("DivergenceError") and "unit 'blocks." in msg, msg
    assert "rank 0: " in reports[0][1] and "rank 1: " in reports[0][1], reports[0][1]
    assert "ranks [0] did not reach that point" in reports[1][1], reports[1][1]
