"""Spawn W ranks (gloo; NCCL with a GPU each), run one function on each, report failures.

Run many cases inside one spawn: spawning costs seconds, a case milliseconds.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class DistributedTestError(AssertionError):
    """One or more ranks failed or hung; the message holds each rank's traceback."""


def _worker(
    fn, rank: int, world_size: int, init_file: str, results, args, timeout: float, cuda: bool,
    threads: int,
) -> None:  # fmt: skip
    torch.set_num_threads(threads)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    try:
        device = torch.device("cuda", rank) if cuda else None
        if device is not None:
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
            **({"device_id": device} if device is not None else {}),
        )
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()  # tensors travel as bytes: shared memory dies with this process
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    pg_timeout: float | None = None,
    cuda: bool = False,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on spawned ranks; return each rank's result.

    ``fn`` must be importable (a module-level function). Any rank's exception is raised
    here with its rank and traceback; ranks still running ``timeout`` seconds after the
    start (or 10 s after another rank failed) are killed and reported as hung. The process
    group's own timeout (a collective's, before the backend fails it) is ``pg_timeout``,
    by default ``timeout``: a test of what a rank does when its collective times out sets
    it well under ``timeout``, so that the harness never kills first. ``cuda``: NCCL, rank
    r on GPU r; ``threads``: each rank's intra-op threads.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fsdp_lite_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    rank,
                    world_size,
                    init_file,
                    results,
                    args,
                    pg_timeout or timeout,
                    cuda,
                    threads,
                ),  # fmt: skip
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        reports = _collect(results, procs, timeout)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    failures = [f"--- rank {r} failed ---\n{v}" for r, (ok, v) in sorted(reports.items()) if not ok]
    hung = [r for r in range(world_size) if r not in reports]
    if hung:
        failures.append(f"--- ranks {hung} hung or died without a report (killed) ---")
    if failures:
        raise DistributedTestError(f"{fn.__name__} on {world_size} ranks:\n" + "\n".join(failures))
    return [torch.load(io.BytesIO(reports[r][1]), weights_only=False) for r in range(world_size)]


def _collect(results, procs, timeout: float) -> dict[int, tuple[bool, Any]]:
    reports: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(reports) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
            reports[rank] = (ok, value)
            if not ok:  # peers may now wait forever on the failed rank
                deadline = min(deadline, time.monotonic() + 10.0)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    return reports


@contextlib.contextmanager
def fake_group(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` on torch's fake process group:
    collectives complete at once and move nothing, so one process shows what one rank of
    a real job holds and does on its host (per-rank memory, host time, bytes issued)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
