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
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

_STEP = "fsdp_lite::measured_step"
# Profiler regions of the wrappers and the optimizer: where live_at_peak says memory came from.
REGIONS = ("fsdp_lite::", "FSDP::", "Optimizer.")


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
    optimizer state exists), ``resident_bytes`` (live when the last step began), and
    ``live_at_peak`` (what is live at that peak, by where it was allocated). A step is a
    ``label`` profiler region: ``step()`` opens one.
    """

    device: torch.device | str = "cpu"
    label: str = _STEP
    step_peaks: list[int] = field(default_factory=list)
    resident_bytes: int = 0
    _prof: profile | None = None
    _nodes: list = field(default_factory=list)  # every profiler event, after the context
    _events: list = field(default_factory=list)  # (time, +-bytes, allocation node)

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
        self._prof = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Mark one training step (forward, backward, optimizer step)."""
        with record_function(self.label):
            yield

    @property
    def peak_bytes(self) -> int:
        """The highest live total inside any step after the first (the only one if one)."""
        steady = self.step_peaks[1:] or self.step_peaks
        if not steady:
            raise RuntimeError("MemoryRecorder: no step was recorded (use `with rec.step():`)")
        return max(steady)

    def _steps(self) -> list[tuple[int, int]]:
        return sorted((n.start_time_ns, n.end_time_ns) for n in self._nodes if n.name == self.label)

    def _read(self, prof: profile) -> None:
        self._nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
        self._events = _live_events(self._nodes, torch.device(self.device).type)
        windows = self._steps()
        self.step_peaks = [0] * len(windows)
        live = 0
        i = 0
        for k, (start, end) in enumerate(windows):
            while i < len(self._events) and self._events[i][0] < start:
                live += self._events[i][1]
                i += 1
            if k == len(windows) - 1:
                self.resident_bytes = live
            peak = live
            while i < len(self._events) and self._events[i][0] <= end:
                live += self._events[i][1]
                peak = max(peak, live)
                i += 1
            self.step_peaks[k] = peak

    def live_at_peak(
        self,
        categorize: Callable[[list[str]], str],
        phases: Sequence[str] = (),
        top: int = 25,
        regions: Sequence[str] = REGIONS,
    ) -> dict[str, Any]:
        """What is live at ``peak_bytes``'s moment: by origin (the profiler regions named
        ``regions...`` or ``phases`` open at its allocation, the autograd node that ran, and
        the outermost aten op below them; "allocated before this step" for what was) and
        by ``categorize(origin)`` ("resident" for the latter); the phase (a region named in
        ``phases``) the peak is in, the highest total inside each phase, and the regions
        open at the peak."""
        steps = self._steps()
        windows = steps[1:] or steps
        if not windows:
            return {}
        spans = [
            (n.start_time_ns, n.end_time_ns, n.name)
            for n in self._nodes
            if n.name in phases and n.start_time_ns >= windows[0][0]
        ]
        peak_i, phase_peaks = _sweep(self._events, windows, spans)
        if peak_i < 0:
            return {}
        t_peak = self._events[peak_i][0]
        step_start = max(a for a, _ in steps if a <= t_peak)
        alive: dict[int, Any] = {}
        for _, delta, n in self._events[: peak_i + 1]:
            if delta > 0:
                alive[id(n)] = n
            else:
                alive.pop(id(n), None)
        kept = (*regions, *phases)
        groups: dict[str, int] = defaultdict(int)
        cats: dict[str, int] = defaultdict(int)
        for n in alive.values():
            size = n.extra_fields.alloc_size
            if n.start_time_ns < step_start:
                key, cat = "allocated before this step", "resident"
            else:
                origin = _origin(n, kept)
                key, cat = " > ".join(origin), categorize(origin)
            groups[key] += size
            cats[cat] += size
        ranked = sorted(groups.items(), key=lambda kv: -kv[1])
        return {
            "peak_bytes": sum(cats.values()),
            "phase": next((name for a, b, name in spans if a <= t_peak <= b), "step"),
            "phase_peaks": phase_peaks,
            "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
            "origins": [{"origin": k, "bytes": v} for k, v in ranked[:top]],
            "where": _where(self._nodes, t_peak, kept),
        }


def _live_events(nodes: list, device_type: str) -> list[tuple[int, int, Any]]:
    """(time, +-bytes, allocation node) of the allocations made while recording and of
    their frees, matched by address, in time order; frees of blocks allocated before
    recording began are left out."""
    allocs = sorted(
        (n for n in nodes if n.tag == _EventType.Allocation),
        key=lambda n: (n.start_time_ns, n.extra_fields.ptr, n.extra_fields.alloc_size),
    )
    live: dict[int, Any] = {}  # address -> allocation node
    events = []
    for n in allocs:
        f = n.extra_fields
        if f.device.type != device_type:
            continue
        if f.alloc_size > 0:
            if (old := live.pop(f.ptr, None)) is not None:  # its free was another thread's
                events.append((n.start_time_ns, -old.extra_fields.alloc_size, old))
            live[f.ptr] = n
            events.append((n.start_time_ns, f.alloc_size, n))
        elif (old := live.pop(f.ptr, None)) is not None:
            events.append((n.start_time_ns, f.alloc_size, old))
    return events


def _walk(nodes: list) -> Iterator:
    for n in nodes:
        yield n
        yield from _walk(n.children)


_AUTOGRAD = "autograd::engine::evaluate_function: "


def _origin(node: Any, kept: Sequence[str]) -> list[str]:
    """An allocation's context, outermost first: the regions named ``kept...``, the
    autograd node that ran, and the outermost aten op below the innermost of those."""
    chain = []
    p = node.parent
    while p is not None:
        chain.append(p.name)
        p = p.parent
    chain.reverse()
    names: list[str] = []
    op = None
    for name in chain:
        if name.startswith(tuple(kept)) or name.startswith(_AUTOGRAD):
            names.append(name.removeprefix(_AUTOGRAD))
            op = None
        elif op is None and name.startswith("aten::"):
            op = name
    return names + ([op] if op else [])


def _sweep(events: list, windows: list, spans: list) -> tuple[int, dict[str, int]]:
    """Index of the event at the peak inside ``windows``, and the peak inside each span."""
    live = peak = 0
    peak_i = -1
    phase_peaks: dict[str, int] = defaultdict(int)
    for i, (t, delta, _) in enumerate(events):
        live += delta
        if not any(a <= t <= b for a, b in windows):
            continue
        if live > peak:
            peak, peak_i = live, i
        for a, b, name in spans:
            if a <= t <= b:
                phase_peaks[name] = max(phase_peaks[name], live)
    return peak_i, dict(phase_peaks)


def _where(nodes: list, t: int, kept: Sequence[str]) -> list[str]:
    """The regions (and autograd nodes) open at time ``t``, outermost first."""
    open_ = [
        n
        for n in nodes
        if n.start_time_ns <= t <= n.end_time_ns
        and (n.name.startswith(tuple(kept)) or n.name.startswith(_AUTOGRAD))
    ]
    open_.sort(key=lambda n: n.start_time_ns)
    return [n.name.removeprefix(_AUTOGRAD) for n in open_]


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the storages behind ``tensors`` (a DTensor's local part), each counted
    once, also across calls that share ``seen``."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        s = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total
