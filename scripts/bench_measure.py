"""What the benchmark observes, the same way for every system: the collectives each
rank issues (patched in at the ProcessGroup) and the tensor memory it holds (from the
torch profiler's allocator events)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._C._profiler import _EventType
from torch.profiler import profile

# -- collectives, observed at the ProcessGroup methods every Python caller goes through ----

# ProcessGroup method -> (kind, index of the argument whose size is the collective's buffer).
# torch.distributed's functions (all_gather_into_tensor, _all_gather_base, all_reduce, ...)
# all end in one of these methods, whichever alias a library imported, so one patch sees
# FSDP2, FSDP1, fsdp_lite and DDP's stock all-reduce comm hook alike, each call once.
_GATHERS = ("all_gather_single", "_allgather_base", "allgather", "allgather_coalesced",
            "allgather_into_tensor_coalesced", "all_gather_single_coalesced")  # fmt: skip
_SCATTERS = ("reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter",
             "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced")  # fmt: skip
_PG_METHODS = {
    **dict.fromkeys(_GATHERS, ("all_gather", 0)),  # the output spans the whole buffer
    **dict.fromkeys(_SCATTERS, ("reduce_scatter", 1)),  # the input does
    **dict.fromkeys(("allreduce", "allreduce_coalesced"), ("all_reduce", 0)),
    "broadcast": ("broadcast", 0),
}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def wire_bytes(kind: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends for a collective spanning ``nbytes`` (ring algorithms)."""
    share = (world - 1) / world
    if kind == "all_reduce":  # a reduce-scatter plus an all-gather
        return 2 * share * nbytes
    # A broadcast: the source sends the buffer to its W-1 peers, so (W-1)/W of it per rank
    # when, as in fsdp_lite's gloo all-gather, every rank calls the same broadcasts.
    return share * nbytes


@contextlib.contextmanager
def count_collectives() -> Iterator[dict[str, dict[str, float]]]:
    """Patch the ProcessGroup collectives; yield {kind: {calls, bytes, wire_bytes}}."""
    counts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    pg_cls = dist.ProcessGroup
    # The class __dict__ entries (pybind11 instance-method descriptors), so restoring
    # them keeps them bound methods; getattr(cls, name) would return plain functions.
    originals = {name: vars(pg_cls)[name] for name in _PG_METHODS if name in vars(pg_cls)}

    def patched(name: str, orig: Callable) -> Callable:
        kind, arg = _PG_METHODS[name]

        def call(self: dist.ProcessGroup, *args: Any, **kwargs: Any) -> Any:
            nbytes = _nbytes(args[arg]) if len(args) > arg else 0
            c = counts[kind]
            c["calls"] += 1
            c["bytes"] += nbytes
            # gloo has no reduce-scatter: ProcessGroupGloo runs it as an all-reduce of a copy.
            on_gloo = kind == "reduce_scatter" and "gloo" in dist.get_backend(self)
            c["wire_bytes"] += wire_bytes("all_reduce" if on_gloo else kind, nbytes, self.size())
            return orig(self, *args, **kwargs)

        return call

    for name, orig in originals.items():
        setattr(pg_cls, name, patched(name, orig))
    try:
        yield counts
    finally:
        for name, orig in originals.items():
            setattr(pg_cls, name, orig)


# -- memory ------------------------------------------------------------------------------


def peak_from_profile(
    prof: profile, device: torch.device, label: str = "bench::step"
) -> dict[str, float]:
    """Peak and resident live bytes inside the profiled ``label`` regions after the first."""
    nodes = list(walk(prof.profiler.kineto_results.experimental_event_tree()))
    steps = sorted((n.start_time_ns, n.end_time_ns) for n in nodes if n.name == label)
    windows = steps[1:] or steps
    live = peak = 0
    resident = None  # live bytes when the last counted step starts
    for t, delta in _memory_deltas(nodes, device, steps):
        if resident is None and windows and t >= windows[-1][0]:
            resident = live
        live += delta
        if any(a <= t <= b for a, b in windows):
            peak = max(peak, live)
    return {"peak_bytes": float(peak), "resident_bytes": float(resident or 0)}


def walk(nodes: list) -> Iterator:
    for n in nodes:
        yield n
        yield from walk(n.children)


def _memory_deltas(nodes: list, device: torch.device, steps: list) -> list[tuple[int, int]]:
    """(time, +-bytes) of every allocation and free on ``device``, matched by address.

    The profiler records only what the profiled thread does, so a buffer freed by a
    communication thread (gloo's copy of a reduce-scatter input, a cast kept alive by an
    async work handle) has no free event. Such a block is taken as freed when the
    collective that allocated it returns, else when its step ends or its address is
    reused, whichever comes first. Frees of blocks allocated before profiling are ignored.
    """
    allocs = sorted(
        (n for n in nodes if n.tag == _EventType.Allocation),
        key=lambda n: n.start_time_ns,
    )
    live: dict[int, Any] = {}  # address -> allocation node
    deltas: list[tuple[int, int]] = []
    for n in allocs:
        f = n.extra_fields
        if f.device.type != device.type:
            continue
        if f.alloc_size > 0:
            if f.ptr in live:  # reused: its free was missed
                deltas.append(missed_free(live.pop(f.ptr), n.start_time_ns, steps))
            live[f.ptr] = n
            deltas.append((n.start_time_ns, f.alloc_size))
        elif live.pop(f.ptr, None) is not None:
            deltas.append((n.start_time_ns, f.alloc_size))
    deltas += [missed_free(n, 2**63, steps) for n in live.values()]
    return sorted(deltas)


def missed_free(alloc: Any, reused_at: int, steps: list) -> tuple[int, int]:
    t = alloc.start_time_ns
    end = next((b for a, b in steps if a <= t <= b), reused_at)
    p = alloc.parent
    while p is not None:
        if p.name.startswith("c10d::"):
            end = p.end_time_ns
            break
        p = p.parent
    return min(end, reused_at), -alloc.extra_fields.alloc_size
