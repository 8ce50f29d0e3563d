"""The only module that calls torch.distributed.

Everything that talks to other ranks goes through the free functions here, which
take everything they need as arguments. They count calls and bytes per collective
(see ``accounting.py``), short-circuit world size 1 (no communication), and are
the seam tests patch to observe what crosses the wire.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from fsdp_lite import accounting
from fsdp_lite.accounting import comm_stats, reset_comm_stats  # noqa: F401 - re-exported

ProcessGroup = dist.ProcessGroup

# torch >= 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle:
    """An in-flight collective. ``wait()`` blocks (gloo) or makes the current CUDA stream
    wait (NCCL) until it is done, and records the time it was exposed."""

    def __init__(self, work: Any, unit: str | None, device: torch.device) -> None:
        self.work = work
        self.unit = unit
        self.device = device

    def wait(self) -> None:
        if self.work is None:
            return
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            self.work.wait()
            end.record()
            accounting.record_cuda_wait(self.unit, start, end)
        else:
            t0 = time.perf_counter()
            self.work.wait()
            accounting.record_wait(self.unit, time.perf_counter() - t0)
        self.work = None


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
        device = (
            torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished the work queued on its current stream."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def all_gather_flat(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup,
    *,
    async_op: bool = False,
    unit: str | None = None,
) -> Handle:
    """Gather every rank's equal-sized 1-D ``shard`` into ``output`` (rank order).

    With ``async_op`` the result is valid only after the returned handle's ``wait()``;
    keep ``shard`` alive until then.
    """
    if world_size(group) == 1:
        output.copy_(shard)
        return Handle(None, unit, output.device)
    accounting.record_collective("all_gather", output, unit)
    work = _all_gather_flat(output, shard, group=group, async_op=True)
    handle = Handle(work, unit, output.device)
    if not async_op:
        handle.wait()
    return handle


def reduce_scatter_flat(
    output: torch.Tensor, full: torch.Tensor, group: ProcessGroup, *, unit: str | None = None
) -> Handle:
    """Sum ``full`` over ranks and leave rank r's contiguous 1/W slice in ``output``.

    Worked example, W=2, each rank holding full = [a0, a1, a2, a3] / [b0, b1, b2, b3]:
    rank 0 ends with [a0+b0, a1+b1], rank 1 with [a2+b2, a3+b3]. Asynchronous: ``output``
    is valid only after the returned handle's ``wait()``; keep ``full`` alive until then.
    """
    if world_size(group) == 1:
        output.copy_(full)
        return Handle(None, unit, output.device)
    accounting.record_collective("reduce_scatter", full, unit)
    work = _reduce_scatter_flat(output, full, group=group, async_op=True)
    return Handle(work, unit, output.device)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, op: str = "sum") -> None:
    """In-place all-reduce with ``op`` in {"sum", "max"}."""
    if world_size(group) == 1:
        return
    accounting.record_collective("all_reduce", tensor, None)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)


def broadcast(tensor: torch.Tensor, group: ProcessGroup, src_rank: int = 0) -> None:
    """In-place broadcast from the group's rank ``src_rank``."""
    if world_size(group) == 1:
        return
    accounting.record_collective("broadcast", tensor, None)
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


def global_ranks(group: ProcessGroup) -> list[int]:
    """The global rank of each of ``group``'s ranks, in group rank order (no communication)."""
    return [dist.get_global_rank(group, r) for r in range(world_size(group))]
