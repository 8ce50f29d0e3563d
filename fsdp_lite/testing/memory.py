"""Measure the peak tensor memory of training steps from the torch profiler's allocator events.

The profiler reports every allocation and free made through a device's caching allocator
(the CPU allocator too), with the running total of bytes live since profiling began. Start
recording *before* the model is built, so that shards, buffers and optimizer state count:
memory allocated before the profiler started is invisible to it.

    with MemoryRecorder("cpu") as rec:
        model, opt = build()
        for _ in range(3):
            with rec.step():
                train_step(model, opt)
    rec.peak_bytes  # the highest live total inside any step after the first

Frees are matched to allocations by address. The profiler records only the threads it
profiles, so a block freed by a communication thread (gloo's) has no free event: it counts
until its address is reused. Under the fake process group every free is on this thread.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch._C._profiler import _EventType
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

_STEP = "fsdp_lite::measured_step"


class QuietProfile(profile):
    """``torch.profiler.profile`` that does not print kineto's ``USDT:`` lines: kineto
    writes one to stderr at each start and stop whatever ``KINETO_LOG_LEVEL`` says, so
    stderr is pointed at /dev/null for those two calls only."""

    def start(self) -> None:
        with _stderr_silenced():
            super().start()

    def stop(self) -> None:
        with _stderr_silenced():
            super().stop()


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@dataclass
class MemoryRecorder:
    """Records live tensor bytes on ``device`` while its context is open (see module doc).

    After the context closes: ``step_peaks`` (the highest live total inside each step),
    ``peak_bytes`` (the highest over every step after the first: the steady state, when
    optimizer state exists) and ``resident_bytes`` (live when the last step began).
    """

    device: torch.device | str = "cpu"
    step_peaks: list[int] = field(default_factory=list)
    resident_bytes: int = 0
    _prof: profile | None = None

    def __enter__(self) -> MemoryRecorder:
        activities = [ProfilerActivity.CPU]
        if torch.device(self.device).type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = QuietProfile(activities=activities, profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self._read(self._prof)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Mark one training step (forward, backward, optimizer step)."""
        with record_function(_STEP):
            yield

    @property
    def peak_bytes(self) -> int:
        """The highest live total inside any step after the first (the only one if one)."""
        steady = self.step_peaks[1:] or self.step_peaks
        if not steady:
            raise RuntimeError("MemoryRecorder: no step was recorded (use `with rec.step():`)")
        return max(steady)

    def _read(self, prof: profile) -> None:
        nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
        windows = sorted((n.start_time_ns, n.end_time_ns) for n in nodes if n.name == _STEP)
        deltas = _live_deltas(nodes, torch.device(self.device).type)
        self.step_peaks = [0] * len(windows)
        live = 0
        i = 0
        for k, (start, end) in enumerate(windows):
            while i < len(deltas) and deltas[i][0] < start:
                live += deltas[i][1]
                i += 1
            if k == len(windows) - 1:
                self.resident_bytes = live
            peak = live
            while i < len(deltas) and deltas[i][0] <= end:
                live += deltas[i][1]
                peak = max(peak, live)
                i += 1
            self.step_peaks[k] = peak


def _live_deltas(nodes: list, device_type: str) -> list[tuple[int, int]]:
    """(time, +-bytes) of the allocations made while recording and of their frees, matched
    by address; frees of blocks allocated before recording began are left out."""
    events = sorted(
        (n.start_time_ns, n.extra_fields.ptr, n.extra_fields.alloc_size)
        for n in nodes
        if n.tag == _EventType.Allocation and n.extra_fields.device.type == device_type
    )
    live: dict[int, int] = {}
    deltas = []
    for t, ptr, size in events:
        if size > 0:
            if ptr in live:  # its free was not recorded (another thread's): count it now
                deltas.append((t, -live.pop(ptr)))
            live[ptr] = size
            deltas.append((t, size))
        elif live.pop(ptr, None) is not None:
            deltas.append((t, size))
    return deltas


def _walk(nodes: list) -> Iterator:
    for n in nodes:
        yield n
        yield from _walk(n.children)
