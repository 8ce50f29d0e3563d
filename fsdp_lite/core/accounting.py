"""Accounting: what a tree of units communicated, waited for, and allocated for full
parameters.

Each tree keeps a :class:`Ledger`: the units one ``FSDPModule`` call builds share one, and
a root made over units built apart takes its own unit's for its whole tree. A unit hands
its :class:`Tag` (its name and that ledger) to every collective it issues
(``collectives.py``); its flat params report their full-buffer allocations to it
(``flat_param.py``). Users read a model's ledgers through ``fsdp_lite.stats(model)``, per
unit and in total, and call ``fsdp_lite.reset_stats(model)`` once per step to get
per-step figures. Two wrapped models in one process (teacher and student) count apart.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.profiler import record_function


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0  # size of the full (unsharded) buffer each call spans
    dtypes: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # dtype -> calls

    def add(self, other: OpStats) -> None:
        self.calls += other.calls
        self.bytes += other.bytes
        for dtype, calls in other.dtypes.items():
            self.dtypes[dtype] += calls

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "bytes": self.bytes, "dtypes": dict(self.dtypes)}


_MAX_PENDING_EVENTS = 512


@dataclass(eq=False)
class Ledger:
    """What one tree of units did since its last :meth:`reset`."""

    ops: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    unit_ops: dict[str, dict[str, OpStats]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(OpStats))
    )
    unit_exposed_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    exposed_s: float = 0.0
    order_changes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cuda_waits: list[tuple[str, Any, Any]] = field(default_factory=list)  # (unit, start, end)
    # Full-buffer allocations live across resets: owner key -> bytes now.
    allocated: dict[int, int] = field(default_factory=dict)
    full_bytes_now: int = 0  # sum of ``allocated``, kept as it changes
    full_bytes_peak: int = 0
    unsharded_units_peak: int = 0
    _owners: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # unit -> live flats
    live_units: int = 0  # units with a live full buffer: count of _owners above 0

    def collective(self, op: str, tensor: torch.Tensor, unit: str | None) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        for s in (self.ops[op], self.unit_ops[unit or "<none>"][op]):
            s.calls += 1
            s.bytes += nbytes
            s.dtypes[dtype] += 1

    def wait(self, unit: str | None, seconds: float) -> None:
        """Time this rank blocked on a collective that had not finished: exposed
        communication."""
        self.exposed_s += seconds
        self.unit_exposed_s[unit or "<none>"] += seconds

    def cuda_wait(self, unit: str | None, start: Any, end: Any) -> None:
        """A CUDA stream stall between two events, resolved lazily when stats are read (or,
        without blocking, once many are pending, so a run that never reads stats stays
        bounded)."""
        self.cuda_waits.append((unit, start, end))
        if len(self.cuda_waits) >= _MAX_PENDING_EVENTS:
            self.resolve_cuda_waits(block=False)

    def order_changed(self, direction: str) -> None:
        """A pass strayed from the recorded unit order and set a new one
        (schedule.ExecOrder)."""
        self.order_changes[direction] += 1

    def full_allocated(self, flat_key: int, unit_key: int, nbytes: int) -> None:
        """A flat param's full buffer was allocated (constant time: a step reports every
        gather)."""
        self.full_bytes_now += nbytes - self.allocated.get(flat_key, 0)
        self.allocated[flat_key] = nbytes
        self.full_bytes_peak = max(self.full_bytes_peak, self.full_bytes_now)
        self._owners[unit_key] += 1
        if self._owners[unit_key] == 1:
            self.live_units += 1
            self.unsharded_units_peak = max(self.unsharded_units_peak, self.live_units)

    def full_freed(self, flat_key: int, unit_key: int) -> None:
        nbytes = self.allocated.pop(flat_key, None)
        if nbytes is not None:
            self.full_bytes_now -= nbytes
            self._owners[unit_key] -= 1
            if self._owners[unit_key] == 0:
                self.live_units -= 1

    def resolve_cuda_waits(self, block: bool = True) -> None:
        """Turn recorded event pairs into exposed time: all of them (``block``: waits for
        the device), or only those already done."""
        pending = []
        for unit, start, end in self.cuda_waits:
            if block:
                end.synchronize()
            elif not end.query():
                pending.append((unit, start, end))
                continue
            self.wait(unit, start.elapsed_time(end) / 1e3)
        self.cuda_waits[:] = pending

    def reset(self, wait: bool = False) -> None:
        """Start a new accounting period (e.g. a step); live allocations, and CUDA waits
        the device has not reached yet (unless ``wait``), carry over."""
        self.resolve_cuda_waits(block=wait)
        self.ops.clear()
        self.unit_ops.clear()
        self.unit_exposed_s.clear()
        self.exposed_s = 0.0
        self.order_changes.clear()
        self.full_bytes_peak = self.full_bytes_now
        self.unsharded_units_peak = self.live_units


@dataclass(frozen=True, eq=False)
class Tag:
    """Who issues a collective: a unit's name (for the per-unit figures and for messages)
    and the ledger of its tree, which counts it. A collective issued with no tag (one no
    model issues, e.g. ``ShardedGradScaler``'s) is counted nowhere."""

    name: str
    ledger: Ledger


def region(name: str) -> contextlib.AbstractContextManager:
    """A profiler region named ``name`` (``record_function``) while a profiler runs, else
    nothing: entering one costs microseconds per call, several calls per unit per step."""
    if torch.autograd.profiler._is_profiler_enabled:
        return record_function(name)
    return contextlib.nullcontext()


def read(ledgers: Sequence[Ledger], wait: bool = False) -> dict[str, Any]:
    """The figures of ``ledgers`` (a model's trees), summed: see ``fsdp_lite.stats``."""
    ops: dict[str, OpStats] = defaultdict(OpStats)
    unit_ops: dict[str, dict[str, OpStats]] = defaultdict(lambda: defaultdict(OpStats))
    unit_exposed: dict[str, float] = defaultdict(float)
    order_changes: dict[str, int] = defaultdict(int)
    for ledger in ledgers:
        ledger.resolve_cuda_waits(block=wait)
        for op, s in ledger.ops.items():
            ops[op].add(s)
        for name, per_op in ledger.unit_ops.items():
            for op, s in per_op.items():
                unit_ops[name][op].add(s)
        for name, seconds in ledger.unit_exposed_s.items():
            unit_exposed[name] += seconds
        for direction, n in ledger.order_changes.items():
            order_changes[direction] += n
    units = {
        name: {**{op: s.as_dict() for op, s in per_op.items()}, "exposed_s": unit_exposed[name]}
        for name, per_op in unit_ops.items()
    }
    return {
        "collectives": {op: s.as_dict() for op, s in ops.items()},
        "units": units,
        "exposed_s": sum(ledger.exposed_s for ledger in ledgers),
        "order_changes": dict(order_changes),
        "full_bytes_now": sum(ledger.full_bytes_now for ledger in ledgers),
        "full_bytes_peak": sum(ledger.full_bytes_peak for ledger in ledgers),
        "unsharded_units_peak": sum(ledger.unsharded_units_peak for ledger in ledgers),
    }
