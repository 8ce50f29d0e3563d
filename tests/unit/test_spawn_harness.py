"""The spawn harness surfaces a rank's exception with its rank and traceback, kills hung
ranks after the timeout, and returns each rank's result."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from fsdp_lite.testing import DistributedTestError, run_distributed


def _rank_and_world(rank: int, world: int) -> tuple[int, int]:
    return dist.get_rank(), world


def _rank1_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 now waits forever for rank 1


def _rank1_hangs(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(300)


def test_returns_results_in_rank_order() -> None:
    assert run_distributed(_rank_and_world, 2) == [(0, 2), (1, 2)]


def test_reports_failing_rank_with_traceback_and_kills_peer() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as err:
        run_distributed(_rank1_raises, 2, timeout=60)
    msg = str(err.value)
    assert (
        "rank 1 failed" in msg and "ValueError: boom on purpose" in msg and "_rank1_raises" in msg
    )
    assert "rank 0 failed" in msg or "ranks [0] hung" in msg  # gloo notices the peer left
    assert time.monotonic() - start < 60


def test_kills_hung_rank_after_timeout() -> None:
    with pytest.raises(DistributedTestError, match=r"ranks \[1\] hung"):
        run_distributed(_rank1_hangs, 2, timeout=20)


def _returns_tensor(rank: int, world: int):
    import torch

    return {"rank": rank, "t": torch.full((3,), float(rank))}


def test_tensors_come_back_from_ranks() -> None:
    got = run_distributed(_returns_tensor, 2)
    assert [r["t"].tolist() for r in got] == [[0.0] * 3, [1.0] * 3]
