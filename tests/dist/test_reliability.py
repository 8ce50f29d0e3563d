"""Ranks that diverge raise DivergenceError on every rank instead of hanging or training on
mismatched data; a rank that dies makes its peers raise PeerError within the timeout."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import fsdp_lite
from fsdp_lite.collectives import DivergenceError, PeerError
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


def _divergence(rank: int, world: int) -> None:
    inner_route = lambda m: m.module  # noqa: E731
    # 1. First iterations are checked collective by collective: rank 1 runs an extra unit.
    model = _model()
    if rank == 1:
        inner_route(model).route = ("b0", "extra", "b1")
    _expect(
        DivergenceError,
        ["rank 0: all_gather of unit 'b1'", "rank 1: all_gather of unit 'extra'"],
        lambda: _steps(model, 1),
    )
    # 2. Later, the cheap check: same-shaped units swapped silently, caught at the next forward.
    fsdp_lite.collectives.GUARD.iteration = 0
    model = _model(prefetch=None)
    _steps(model, 3)
    if rank == 1:
        inner_route(model).route = ("b1", "b0")
    _steps(model, 1)  # shapes agree, nothing hangs ...
    inner_route(model).route = ("b0", "b1")
    _expect(
        DivergenceError,
        [
            "in the last iteration",
            "rank 0: all_gather of unit 'b0'",
            "rank 1: all_gather of unit 'b1'",
        ],
        lambda: _steps(model, 1),
    )
    # 3. thorough: caught before the collective, at any iteration.
    fsdp_lite.set_divergence_check("thorough")
    model = _model()
    _steps(model, 3)
    if rank == 1:
        inner_route(model).route = ("b0",)
    msg = _expect(
        DivergenceError, ["about to issue different collectives"], lambda: _steps(model, 1)
    )
    # Which collective differs first depends on prefetching; each rank's is named.
    assert "rank 0: " in msg and "rank 1: " in msg, msg
    fsdp_lite.set_divergence_check("cheap")


def test_divergent_ranks_raise_on_every_rank() -> None:
    run_distributed(_divergence, 2, timeout=120)


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
