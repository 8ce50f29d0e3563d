"""The only module that calls torch.distributed.

Everything that talks to other ranks goes through the free functions here, which
take everything they need as arguments. They count calls and bytes per collective
(see ``accounting.py``), short-circuit world size 1 (no communication), and are
the seam tests patch to observe what crosses the wire.
"""

from __future__ import annotations

import contextlib
import os
import time
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fsdp_lite import accounting
from fsdp_lite.accounting import comm_stats, reset_comm_stats  # noqa: F401 - re-exported

ProcessGroup = dist.ProcessGroup

# torch >= 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DivergenceError(RuntimeError):
    """Ranks were about to issue (or issued) different collectives; raised on every rank."""


class PeerError(RuntimeError):
    """A collective failed because a peer rank died or stopped responding."""


@contextlib.contextmanager
def _peer_errors(op: str, unit: str | None) -> Iterator[None]:
    try:
        yield
    except (DivergenceError, PeerError):
        raise
    except RuntimeError as e:  # DistBackendError, gloo/NCCL errors and timeouts
        what = f"{op} of unit '{unit}'" if unit else op
        raise PeerError(
            f"fsdp_lite: {what} failed: a peer rank is gone or did not respond "
            f"within the process group's timeout (set it with init_process_group(timeout=...)). "
            f"The backend said: {e}"
        ) from e


class Handle:
    """An in-flight collective. ``wait()`` blocks (gloo) or makes the current CUDA stream
    wait (NCCL) until it is done, and records the time it was exposed."""

    def __init__(self, work: Any, unit: str | None, device: torch.device) -> None:
        self.work = work
        self.unit = unit
        self.device = device

    @property
    def waited(self) -> bool:
        return self.work is None

    def wait(self) -> None:
        work, self.work = self.work, None  # waited for at most once, even if it fails
        if work is None:
            return
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)  # the one work.wait() holds
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            with _peer_errors("waiting for a collective", self.unit):
                work.wait()
            end.record(stream)
            accounting.record_cuda_wait(self.unit, start, end)
        else:
            t0 = time.perf_counter()
            with _peer_errors("waiting for a collective", self.unit):
                work.wait()
            accounting.record_wait(self.unit, time.perf_counter() - t0)


def require_initialized(what: str = "fsdp_lite.FSDPModule") -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed initialized: call "
            "torch.distributed.init_process_group('nccl' on GPUs or 'gloo' on CPUs) first, "
            "e.g. under torchrun. For a single process use world_size=1."
        )


def resolve_group(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else dist.group.WORLD


def resolve_groups(
    group: ProcessGroup | tuple[ProcessGroup, ProcessGroup] | None,
) -> tuple[ProcessGroup, ProcessGroup | None]:
    """(shard group, replicate group or None) from FSDPModule's ``process_group`` argument."""
    if isinstance(group, tuple):
        if len(group) != 2 or not all(isinstance(g, ProcessGroup) for g in group):
            raise TypeError(
                "process_group for hybrid sharding is a (shard_group, replicate_group) pair, "
                "e.g. fsdp_lite.hybrid_groups(ranks_per_node)"
            )
        return group[0], group[1]
    return resolve_group(group), None


def hybrid_groups(shard_size: int) -> tuple[ProcessGroup, ProcessGroup]:
    """This rank's (shard group, replicate group) for hybrid sharding: shard within blocks of
    ``shard_size`` consecutive ranks (a node), replicate across blocks. Call on every rank."""
    world, me = dist.get_world_size(), dist.get_rank()
    if shard_size < 1 or world % shard_size:
        raise ValueError(
            f"hybrid_groups: shard_size must divide the world size {world}, got {shard_size}"
        )
    shards = [dist.new_group(list(range(s, s + shard_size))) for s in range(0, world, shard_size)]
    replicas = [dist.new_group(list(range(i, world, shard_size))) for i in range(shard_size)]
    return shards[me // shard_size], replicas[me % shard_size]


def rank(group: ProcessGroup) -> int:
    return dist.get_rank(group)


def world_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def default_device(
    device: torch.device | str | int | None, world_size: int | None = None
) -> torch.device:
    """The compute device of this rank.

    The one given (``"cuda"`` without an index: the current CUDA device; an int n:
    ``cuda:n``). Else, when CUDA is available: the current CUDA device when it is
    unambiguous -- the user set one (torch cannot say whether ``torch.cuda.set_device``
    was called, so a current device other than 0 counts as set), exactly one device is
    visible, or ``world_size`` is 1 (default: the default process group's, 1 without
    one) -- else ``cuda:LOCAL_RANK`` (torchrun), else ``RuntimeError``: guessing
    ``cuda:0`` would put every rank of a node on one GPU. CPU without CUDA.
    """
    if device is not None:
        device = (
            torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if not torch.cuda.is_available():
        return torch.device("cpu")
    current, visible = torch.cuda.current_device(), torch.cuda.device_count()
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    if current != 0 or visible == 1 or world_size == 1:
        return torch.device("cuda", current)
    if "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    raise RuntimeError(
        f"fsdp_lite cannot tell which GPU this rank should use: {visible} GPUs are visible, "
        f"the world size is {world_size}, the current CUDA device is 0 (torch's default, "
        "maybe never set) and LOCAL_RANK is not set (launched without torchrun, e.g. by "
        "srun?). Call torch.cuda.set_device(local_rank) before wrapping (under srun "
        "local_rank = int(os.environ['SLURM_LOCALID'])), or pass device= to FSDPModule."
    )


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
    GUARD.before("all_gather", unit, output, group)
    accounting.record_collective("all_gather", output, unit)
    with _peer_errors("all_gather", unit):
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
    GUARD.before("reduce_scatter", unit, full, group)
    accounting.record_collective("reduce_scatter", full, unit)
    with _peer_errors("reduce_scatter", unit):
        work = _reduce_scatter_flat(output, full, group=group, async_op=True)
    return Handle(work, unit, output.device)


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup,
    op: str = "sum",
    *,
    kind: str = "all_reduce",
    unit: str | None = None,
) -> None:
    """In-place all-reduce with ``op`` in {"sum", "max"}; counted under ``kind``."""
    if world_size(group) == 1:
        return
    GUARD.before("all_reduce", unit, tensor, group)
    accounting.record_collective(kind, tensor, unit)
    with _peer_errors(kind, unit):
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        dist.all_reduce(tensor, op=reduce_op, group=group)


def broadcast_from_first(tensor: torch.Tensor, groups: list[ProcessGroup | None]) -> None:
    """Make ``tensor`` equal on all ranks of the given groups (their first rank's value);
    with (replicate, shard) groups, every rank ends with global rank 0's value."""
    for group in groups:
        if group is not None:
            broadcast(tensor, group)


def broadcast(tensor: torch.Tensor, group: ProcessGroup, src_rank: int = 0) -> None:
    """In-place broadcast from the group's rank ``src_rank``."""
    if world_size(group) == 1:
        return
    GUARD.before("broadcast", None, tensor, group)
    accounting.record_collective("broadcast", tensor, None)
    with _peer_errors("broadcast", None):
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


# -- divergence detection ---------------------------------------------------------
# [Note: divergence check]
# Every counted collective extends a running fingerprint (op, unit, element count) and a
# log of the current iteration. "cheap" (the default): at each root forward the ranks
# compare last iteration's fingerprints with one two-element all-reduce; during the first
# two iterations they also check every collective before issuing it. "thorough": every
# collective is checked before it is issued, so ranks about to diverge raise instead of
# hanging. "off": nothing. Set with FSDP_LITE_CHECK or set_divergence_check().

_OPS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "broadcast": 4}
CHECK_MODES = ("off", "cheap", "thorough")


class _Guard:
    def __init__(self) -> None:
        self.mode = os.environ.get("FSDP_LITE_CHECK", "cheap")
        if self.mode not in CHECK_MODES:
            raise ValueError(f"FSDP_LITE_CHECK must be one of {CHECK_MODES}, got {self.mode!r}")
        self.iteration = 0
        self.fingerprint = 0
        self.log: list[tuple[str, str, int]] = []  # this iteration's collectives
        self._busy = False  # the check's own collectives are not checked

    def before(self, op: str, unit: str | None, tensor: torch.Tensor, group: ProcessGroup) -> None:
        if self.mode == "off" or self._busy:
            return
        entry = (op, unit or "-", tensor.numel())
        if self.mode == "thorough" or self.iteration < 2:
            self._compare(entry, group, tensor.device)
        self.log.append(entry)
        self.fingerprint = zlib.crc32(repr(entry).encode(), self.fingerprint)

    def _compare(
        self, entry: tuple[str, str, int], group: ProcessGroup, device: torch.device
    ) -> None:
        # On the collective's device: an NCCL group takes CUDA tensors only.
        code = [_OPS[entry[0]], zlib.crc32(entry[1].encode()), entry[2]]
        mine = torch.tensor(code, dtype=torch.int64, device=device)
        everyone = torch.empty(world_size(group) * 3, dtype=torch.int64, device=device)
        accounting.record_collective("divergence_check", everyone, None)
        self._busy = True
        try:
            with _peer_errors(f"checking {entry[0]}", entry[1]):
                _all_gather_flat(everyone, mine, group=group)
            if bool((everyone.view(-1, 3) == mine).all()):
                return
            entries = all_gather_object(entry, group)
        finally:
            self._busy = False
        about_to = "; ".join(
            f"rank {r}: {op} of unit '{u}' ({n} elements)" for r, (op, u, n) in enumerate(entries)
        )
        raise DivergenceError(
            f"fsdp_lite: ranks were about to issue different collectives ({about_to}). A unit "
            "ran on some ranks but not others, or in a different order: make every rank run "
            "the same units in the same order (no data-dependent skipping of wrapped modules)"
        )

    def end_iteration(self, group: ProcessGroup, device: torch.device) -> None:
        """At the root's forward: compare the last iteration's fingerprints across ranks
        (a two-element all-reduce on ``device``, the root's compute device)."""
        if self.mode == "off" or world_size(group) == 1:
            self.iteration += 1
            return
        both = torch.tensor([self.fingerprint, -self.fingerprint], dtype=torch.int64, device=device)
        accounting.record_collective("divergence_check", both, None)
        self._busy = True
        try:
            with _peer_errors("checking the last iteration", None):
                dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
            differ = int(both[0]) != -int(both[1])
            logs = all_gather_object(self.log, group) if differ else None
        finally:
            self._busy = False
        self.iteration += 1
        self.fingerprint, self.log = 0, []
        if logs is not None:
            raise DivergenceError(_describe_divergence(logs))


def _describe_divergence(logs: list) -> str:
    length = max(len(log) for log in logs)
    for i in range(length):
        seen = [log[i] if i < len(log) else None for log in logs]
        if len(set(seen)) > 1:
            per_rank = "; ".join(
                f"rank {r}: " + (f"{e[0]} of unit '{e[1]}' ({e[2]} elements)" if e else "nothing")
                for r, e in enumerate(seen)
            )
            return (
                f"fsdp_lite: in the last iteration the ranks' collective #{i} differed "
                f"({per_rank}); their results are not to be trusted. A unit ran on some ranks "
                "but not others, or in a different order: make every rank run the same units"
            )
    return "fsdp_lite: the ranks' collectives differed in the last iteration"


GUARD = _Guard()


def set_divergence_check(mode: str) -> None:
    """``"cheap"`` (default), ``"thorough"`` (check before every collective) or ``"off"``."""
    if mode not in CHECK_MODES:
        raise ValueError(f"divergence check must be one of {CHECK_MODES}, got {mode!r}")
    GUARD.mode = mode
