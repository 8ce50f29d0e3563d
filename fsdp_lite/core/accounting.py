"""Accounting: what this rank communicated, waited for, and allocated for full parameters.

Collectives report here (``collectives.py``), flat params report their full-buffer
allocations (``flat_param.py``); users read it all through :func:`stats`, per unit and
in total, and call :func:`reset_stats` once per step to get per-step figures.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.profiler import record_function


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0  # size of the full (unsharded) buffer each call spans
    dtypes: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # dtype -> calls

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "bytes": self.bytes, "dtypes": dict(self.dtypes)}


@dataclass
class _Recorder:
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


# Process-wide by nature: fsdp_lite.stats() reports what this process did, over every
# model and group, since the last reset_stats().
_REC = _Recorder()


def record_collective(op: str, tensor: torch.Tensor, unit: str | None) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    dtype = str(tensor.dtype).removeprefix("torch.")
    for s in (_REC.ops[op], _REC.unit_ops[unit or "<none>"][op]):
        s.calls += 1
        s.bytes += nbytes
        s.dtypes[dtype] += 1


def record_wait(unit: str | None, seconds: float) -> None:
    """Time this rank blocked on a collective that had not finished: exposed communication."""
    _REC.exposed_s += seconds
    _REC.unit_exposed_s[unit or "<none>"] += seconds


def record_cuda_wait(unit: str | None, start: Any, end: Any) -> None:
    """A CUDA stream stall between two events, resolved lazily when stats are read (or,
    without blocking, once many are pending, so a run that never reads stats stays bounded)."""
    _REC.cuda_waits.append((unit, start, end))
    if len(_REC.cuda_waits) >= _MAX_PENDING_EVENTS:
        _resolve_cuda_waits(block=False)


_MAX_PENDING_EVENTS = 512


def order_changed(direction: str) -> None:
    """A pass strayed from the recorded unit order and set a new one (schedule.ExecOrder)."""
    _REC.order_changes[direction] += 1


def full_allocated(flat_key: int, unit_key: int, nbytes: int) -> None:
    """A flat param's full buffer was allocated (constant time: a step reports every gather)."""
    rec = _REC
    rec.full_bytes_now += nbytes - rec.allocated.get(flat_key, 0)
    rec.allocated[flat_key] = nbytes
    rec.full_bytes_peak = max(rec.full_bytes_peak, rec.full_bytes_now)
    rec._owners[unit_key] += 1
    if rec._owners[unit_key] == 1:
        rec.live_units += 1
        rec.unsharded_units_peak = max(rec.unsharded_units_peak, rec.live_units)


def full_freed(flat_key: int, unit_key: int) -> None:
    rec = _REC
    nbytes = rec.allocated.pop(flat_key, None)
    if nbytes is not None:
        rec.full_bytes_now -= nbytes
        rec._owners[unit_key] -= 1
        if rec._owners[unit_key] == 0:
            rec.live_units -= 1


def region(name: str) -> contextlib.AbstractContextManager:
    """A profiler region named ``name`` (``record_function``) while a profiler runs, else
    nothing: entering one costs microseconds per call, several calls per unit per step."""
    if torch.autograd.profiler._is_profiler_enabled:
        return record_function(name)
    return contextlib.nullcontext()


def _resolve_cuda_waits(block: bool = True) -> None:
    """Turn recorded event pairs into exposed time: all of them (``block``: waits for the
    device), or only those already done."""
    pending = []
    for unit, start, end in _REC.cuda_waits:
        if block:
            end.synchronize()
        elif not end.query():
            pending.append((unit, start, end))
            continue
        record_wait(unit, start.elapsed_time(end) / 1e3)
    _REC.cuda_waits[:] = pending


def stats(wait: bool = False) -> dict[str, Any]:
    """Everything recorded on this rank since the last :func:`reset_stats`.

    No host synchronization: on CUDA, ``exposed_s`` counts the waits whose timing events
    the device has reached; ``wait=True`` first waits for the device to reach all of them
    (a host sync, for an exact figure at the end of a run).

    - ``collectives``: per op, calls, bytes (the full buffer each call spans; a ring
      sends (W-1)/W of it) and dtypes. World size 1 communicates nothing. Ops:
      ``all_gather``, ``reduce_scatter``, ``replicate_all_reduce`` (hybrid sharding),
      ``all_reduce`` (e.g. ``clip_grad_norm_``), ``divergence_check`` (a 3-int
      all-gather per collective in the first iteration of each root and after a
      deviation; none in the steady state; see ``set_divergence_check``).
    - ``units``: the same per unit (by module path), plus ``exposed_s``.
    - ``exposed_s``: seconds this rank waited on communication that compute had not
      hidden (CPU blocking time; on CUDA the compute stream's stall).
    - ``order_changes``: per direction (``forward``/``backward``), passes that strayed
      from the recorded unit order and replaced it (prefetching is off for the rest of
      such a pass); 0 once the order is stable. Every step counting: the order changes
      every step (data-dependent control flow), so prefetching rarely runs.
    - ``full_bytes_now`` / ``full_bytes_peak``: bytes of gathered full parameters
      allocated now / at the peak; ``unsharded_units_peak``: most units holding full
      parameters at once.
    """
    _resolve_cuda_waits(block=wait)
    units = {
        name: {
            **{op: s.as_dict() for op, s in ops.items()},
            "exposed_s": _REC.unit_exposed_s.get(name, 0.0),
        }
        for name, ops in _REC.unit_ops.items()
    }
    return {
        "collectives": {op: s.as_dict() for op, s in _REC.ops.items()},
        "units": units,
        "exposed_s": _REC.exposed_s,
        "order_changes": dict(_REC.order_changes),
        "full_bytes_now": _REC.full_bytes_now,
        "full_bytes_peak": _REC.full_bytes_peak,
        "unsharded_units_peak": _REC.unsharded_units_peak,
    }


def reset_stats(wait: bool = False) -> None:
    """Start a new accounting period (e.g. a step); live allocations, and CUDA waits the
    device has not reached yet (unless ``wait``, see :func:`stats`), carry over."""
    _resolve_cuda_waits(block=wait)
    _REC.ops.clear()
    _REC.unit_ops.clear()
    _REC.unit_exposed_s.clear()
    _REC.exposed_s = 0.0
    _REC.order_changes.clear()
    _REC.full_bytes_peak = _REC.full_bytes_now
    _REC.unsharded_units_peak = _REC.live_units
