"""The only module that calls torch.distributed.

Everything that talks to other ranks goes through the free functions here, which
take everything they need as arguments. They count calls and bytes per collective
(see :func:`comm_stats`), short-circuit world size 1 (no communication), and are
the seam tests patch to observe what crosses the wire.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

# torch >= 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class OpStats:
    """Counters for one kind of collective, as seen by this rank."""

    calls: int = 0
    bytes: int = 0  # size of the full (unsharded) buffer the collective spans, per call
    dtypes: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # dtype -> calls


_STATS: dict[str, OpStats] = defaultdict(OpStats)


def comm_stats() -> dict[str, dict]:
    """Calls and bytes per collective on this rank since the last :func:`reset_comm_stats`.

    ``bytes`` is the size of the full buffer each collective spans (for an all-gather
    the gathered output, for a reduce-scatter its input); a ring implementation sends
    (W-1)/W of it per rank. World size 1 moves nothing and is not counted.
    """
    return {
        op: {"calls": s.calls, "bytes": s.bytes, "dtypes": dict(s.dtypes)}
        for op, s in _STATS.items()
    }


def reset_comm_stats() -> None:
    _STATS.clear()


def _record(op: str, tensor: torch.Tensor) -> None:
    s = _STATS[op]
    s.calls += 1
    s.bytes += tensor.numel() * tensor.element_size()
    s.dtypes[str(tensor.dtype).removeprefix("torch.")] += 1


class _DoneWork:
    """Stands in for an async work handle when nothing was communicated."""

    def wait(self) -> bool:
        return True


def require_initialized(what: str = "fsdp_lite.FSDPModule") -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed initialized: call "
            "torch.distributed.init_process_group('nccl' on GPUs or 'gloo' on CPUs) first, "
            "e.g. under torchrun. For a single process use world_size=1."
        )


def resolve_group(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else dist.group.WORLD


def rank(group: ProcessGroup) -> int:
    return dist.get_rank(group)


def world_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def default_device(device: torch.device | str | int | None) -> torch.device:
    """The compute device: the one given, else cuda:LOCAL_RANK if CUDA is available, else cpu."""
    if device is not None:
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup) -> None:
    """Gather every rank's equal-sized 1-D ``shard`` into ``output`` (rank order)."""
    if world_size(group) == 1:
        output.copy_(shard)
        return
    _record("all_gather", output)
    _all_gather_flat(output, shard, group=group)


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor, group: ProcessGroup):
    """Sum ``full`` over ranks and leave rank r's contiguous 1/W slice in ``output``.

    Worked example, W=2, each rank holding full = [a0, a1, a2, a3] / [b0, b1, b2, b3]:
    rank 0 ends with [a0+b0, a1+b1], rank 1 with [a2+b2, a3+b3]. Returns an async
    work handle; ``output`` is valid only after ``.wait()``.
    """
    if world_size(group) == 1:
        output.copy_(full)
        return _DoneWork()
    _record("reduce_scatter", full)
    return _reduce_scatter_flat(output, full, group=group, async_op=True)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, op: str = "sum") -> None:
    """In-place all-reduce with ``op`` in {"sum", "max"}."""
    if world_size(group) == 1:
        return
    _record("all_reduce", tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)


def broadcast(tensor: torch.Tensor, group: ProcessGroup, src_rank: int = 0) -> None:
    """In-place broadcast from the group's rank ``src_rank``."""
    if world_size(group) == 1:
        return
    _record("broadcast", tensor)
    dist.broadcast(tensor, src=dist.get_global_rank(group, src_rank), group=group)



def barrier(group: ProcessGroup) -> None:
    if world_size(group) > 1:
        dist.barrier(group=group)


def broadcast_object(obj: object, group: ProcessGroup, src_rank: int = 0) -> object:
    """Rank ``src_rank``'s picklable ``obj`` on every rank of ``group``."""
    if world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src_rank), group=group)
    return box[0]


def all_gather_object(obj: object, group: ProcessGroup) -> list[object]:
    """Every rank's picklable ``obj``, in group rank order."""
    if world_size(group) == 1:
        return [obj]
    out: list[object] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
