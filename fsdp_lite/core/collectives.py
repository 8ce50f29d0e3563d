"""The only module that calls torch.distributed, as torch ships it (c10d's collectives on
gloo or NCCL: no transport of our own).

Everything that talks to other ranks goes through the free functions here, which
take everything they need as arguments: among them the issuer's ``Tag``, whose ledger
counts calls and bytes per collective (``accounting.py``). They short-circuit world size 1
(no communication), and are the seam tests patch to observe what crosses the wire.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import math
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fsdp_lite.core.accounting import Tag

ProcessGroup = dist.ProcessGroup

# torch >= 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DivergenceError(RuntimeError):
    """Ranks were about to issue (or issued) different collectives. On gloo raised on every
    rank; on NCCL, whose waits never raise, on the rank that strayed (its peers are
    aborted by NCCL's watchdog at the process group's timeout)."""


class PeerError(RuntimeError):
    """A collective failed because a peer rank died or stopped responding (gloo; on NCCL
    the watchdog aborts the process instead)."""


# What a backend raises when a peer is gone or too slow; anything else raised inside a
# collective call (a CPU tensor on an NCCL group, a wrong size) is a local error and
# propagates unchanged.
_PEER_FAILURE_TEXT = ("connection closed by peer", "connection reset", "timed out", "timeout")
_WAIT_TIMED_OUT = "Operation timed out!"  # Work.wait(timeout) ran out; the work goes on
STALL_SECONDS = 1.0  # a wait still blocked this long looks for a divergence check to answer


def _is_peer_failure(e: BaseException) -> bool:
    if isinstance(e, dist.DistNetworkError | dist.DistBackendError | dist.DistStoreError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(t in text for t in _PEER_FAILURE_TEXT)


@contextlib.contextmanager
def _peer_errors(op: str, tag: Tag | None, group: ProcessGroup | None = None) -> Iterator[None]:
    try:
        yield
    except (DivergenceError, PeerError):
        raise
    except RuntimeError as e:
        if not _is_peer_failure(e):
            raise
        what = f"{op} of unit '{tag.name}'" if tag is not None else op
        # The error path only: a peer that turned off the agreed iterations left its entry
        # in the store (the divergence check's post-mortem, see Note).
        check = group_state(group).check if group is not None else None
        turned = check.post_mortem(group) if check is not None else None
        if turned is not None:
            raise DivergenceError(f"fsdp_lite: {what} failed: {turned}") from e
        raise PeerError(
            f"fsdp_lite: {what} failed: a peer rank is gone or did not respond "
            f"within the process group's timeout (set it with init_process_group(timeout=...)). "
            f"The backend said: {e}"
        ) from e


class Handle:
    """An in-flight collective. ``wait()`` blocks (gloo) or makes the current CUDA stream
    wait (NCCL) until it is done, records the time it was exposed, then runs ``after``
    (a copy back from the process group's device)."""

    def __init__(
        self,
        work: Any,
        tag: Tag | None,
        device: torch.device,
        group: ProcessGroup | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        self.work = work
        self.tag = tag  # who issued it: its unit's name, counted in its tree's ledger
        self.device = device
        self.group = group
        self.after = after
        # The work while its wait runs, kept (with its buffers) if that wait raised.
        self.pending_work: Any = None

    @property
    def waited(self) -> bool:
        return self.work is None

    def wait(self, exposed: bool = True) -> None:
        """``exposed=False``: a CUDA wait on a side stream, which holds up no compute (not
        counted as exposed communication time)."""
        work = self.work
        if work is None:
            return  # waited for at most once, even if that wait failed
        # Referenced until the wait returns: if it raises while the collective is still in
        # flight, the buffers the work writes must not be freed under it.
        self.pending_work, self.work = work, None
        ledger = self.tag.ledger if self.tag is not None else None
        if self.device.type == "cuda" and (not exposed or ledger is None):
            with _peer_errors("waiting for a collective", self.tag, self.group):
                work.wait()  # nothing to time: no compute held up, or nobody counting
        elif self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)  # the one work.wait() holds
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            with _peer_errors("waiting for a collective", self.tag, self.group):
                work.wait()
            end.record(stream)
            ledger.cuda_wait(self.tag.name, start, end)
        else:
            t0 = time.perf_counter()
            with _peer_errors("waiting for a collective", self.tag, self.group):
                _wait_watching_for_divergence(work, self.group)
            if ledger is not None:
                ledger.wait(self.tag.name, time.perf_counter() - t0)
        self.pending_work = None
        after, self.after = self.after, None  # it may hold the collective's buffers
        if after is not None:
            after()


def _wait_watching_for_divergence(work: Any, group: ProcessGroup | None) -> None:
    """Block until ``work`` is done. Every ``STALL_SECONDS`` still waiting, see whether a
    peer rank opened a divergence check this rank should answer (core/divergence.py)."""
    check = group_state(group).check if group is not None else None
    if check is None or not check.watching():
        work.wait()
        return
    while True:
        try:
            work.wait(datetime.timedelta(seconds=STALL_SECONDS))
            return
        except RuntimeError as e:
            if str(e) != _WAIT_TIMED_OUT:
                raise
        check.answer_open_check(group)


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


def mesh_groups(
    mesh: object, process_group: object
) -> ProcessGroup | tuple[ProcessGroup, ProcessGroup]:
    """FSDPModule's ``process_group`` from FSDP2's ``mesh=``: a 1-D ``DeviceMesh`` is the
    shard group; a 2-D one is (replicate, shard) -- hybrid sharding, as FSDP2 reads it."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    if process_group is not None:
        raise ValueError(
            "FSDPModule got both mesh= and process_group=: pass one (mesh=dp_mesh, FSDP2's "
            "name, or process_group=, a group or a (shard, replicate) pair)"
        )
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1:
        return mesh.get_group(0)
    if mesh.ndim == 2:
        return mesh.get_group(1), mesh.get_group(0)  # (shard, replicate)
    raise ValueError(
        f"FSDPModule(mesh=...) takes a 1-D mesh (shard over it) or a 2-D mesh with dims "
        f"(replicate, shard); got a {mesh.ndim}-D mesh{f' with dims {names}' if names else ''}. "
        "Pass the data-parallel slice of the world mesh, e.g. world['dp'] or "
        "world['dp_replicate', 'dp_shard']"
    )


def separate_group(group: ProcessGroup) -> ProcessGroup:
    """A second process group over ``group``'s ranks (one per rank set, cached), for the
    reduce-scatters: one NCCL communicator runs one collective at a time, whatever the
    streams, so a backward prefetch's all-gather would queue behind the previous unit's
    reduce-scatter. Collective over ``group``'s members only (local synchronization),
    except where NCCL was initialized eagerly (a bound device): the new communicator is
    then split from the world's, which every rank of the world must join."""
    state = group_state(group)
    if state.separate is None:
        ranks = dist.get_process_group_ranks(group)
        state.separate = dist.new_group(ranks, use_local_synchronization=True)
    return state.separate


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


def world_size(group: ProcessGroup | None) -> int:
    """``dist.get_world_size(group)``, asked once per group: before every collective it
    cost a few microseconds of host time."""
    if group is None:
        return dist.get_world_size()
    state = group_state(group)
    if state.size is None:
        state.size = dist.get_world_size(group)
    return state.size


def comm_device(group: ProcessGroup, device: torch.device) -> torch.device:
    """Where a collective on ``group`` runs for a tensor on ``device``: that device if the
    group's backend takes it, else the backend's (NCCL takes CUDA tensors only: CPU-offloaded
    shards and CPU state are staged on the current CUDA device)."""
    state = group_state(group)
    types = state.device_types
    if types is None:
        types = state.device_types = {d.type for d in getattr(group, "_device_types", [])}
    if not types or device.type in types:
        return device
    if "cuda" in types:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class CollectiveCheck(Protocol):
    """What the collectives ask of a process group's divergence check
    (``divergence._Check``, which registers itself in :attr:`GroupState.check`)."""

    def before(self, op: str, tag: Tag | None, tensor: torch.Tensor, group: ProcessGroup) -> None:
        """Called before each collective on the group (``tag``: who issues it)."""

    def watching(self) -> bool:
        """Should a long wait look for a peer's open check?"""

    def answer_open_check(self, group: ProcessGroup) -> None:
        """Answer a check a peer rank opened, if any."""

    def post_mortem(self, group: ProcessGroup) -> str | None:
        """After a collective failed: what a peer that left the agreed path posted."""


@dataclasses.dataclass
class GroupState:
    """What fsdp_lite keeps per process group, for as long as the group object lives: a
    group made after ``destroy_process_group`` starts empty, even where it reuses a name."""

    backend: str | None = None  # dist.get_backend, asked once
    size: int | None = None  # dist.get_world_size, asked once
    device_types: set[str] | None = None  # the device types its backend takes
    separate: ProcessGroup | None = None  # separate_group's second group over its ranks
    owned: list[int] | None = None  # whole params' bytes owned per rank so far (ownership)
    check: CollectiveCheck | None = None  # its divergence check, once a root ran on it


def group_state(group: ProcessGroup) -> GroupState:
    """``group``'s :class:`GroupState` (made on first use)."""
    state = _GROUP_STATES.get(group)
    if state is None:
        state = _GROUP_STATES[group] = GroupState()
    return state


# Keyed weakly by the group: the state dies with it, and a new group after
# destroy_process_group starts clean.
_GROUP_STATES: weakref.WeakKeyDictionary[ProcessGroup, GroupState] = weakref.WeakKeyDictionary()


def forget_owned() -> None:
    """Drop every live group's whole-params ownership counts (``ownership.forget_owned``)."""
    for state in list(_GROUP_STATES.values()):
        state.owned = None


def _staged(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.to(device)


def _copy_back(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None] | None:
    return None if src is dst else lambda: dst.copy_(src)


def _begin(
    op: str,
    tag: Tag | None,
    tensor: torch.Tensor,
    group: ProcessGroup,
    near: torch.device,
    kind: str | None = None,
) -> torch.device | None:
    """Before each collective: None at world size 1 (nothing to communicate); else the
    divergence check and the accounting (under ``kind``, default ``op``) have run, and the
    device the collective runs on for data near ``near`` is returned."""
    if world_size(group) == 1:
        return None
    check = group_state(group).check  # core/divergence.py's, once a root ran
    if check is not None:
        check.before(op, tag, tensor, group)
    if tag is not None:
        tag.ledger.collective(kind or op, tensor, tag.name)
    return comm_device(group, near)


def all_gather_flat(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup,
    *,
    async_op: bool = False,
    tag: Tag | None = None,
    sizes: list[int] | None = None,
) -> Handle:
    """Gather every rank's 1-D ``shard`` into ``output`` (rank order): equal-sized, or of
    ``sizes[r]`` elements on rank r (whole-param sharding; some may be 0).

    With ``async_op`` the result is valid only after the returned handle's ``wait()``;
    keep ``shard`` alive until then.
    """
    device = _begin("all_gather", tag, output, group, output.device)
    if device is None:
        output.copy_(shard)
        return Handle(None, tag, output.device)
    out = output if output.device == device else torch.empty_like(output, device=device)
    staged = _staged(shard, device)
    with _peer_errors("all_gather", tag):
        if _on_gloo(group, device) or (sizes is not None and not _on_nccl(group, device)):
            work = _gather_by_broadcasts(_rows(out, sizes, group), staged, group)
        elif sizes is not None:  # NCCL: a grouped broadcast per rank
            work = dist.all_gather(_rows(out, sizes, group), staged, group=group, async_op=True)
        else:
            work = _all_gather_flat(out, staged, group=group, async_op=True)
    handle = Handle(work, tag, device, group, _copy_back(output, out))
    if not async_op:
        handle.wait()
    return handle


def _rows(flat: torch.Tensor, sizes: list[int] | None, group: ProcessGroup) -> list[torch.Tensor]:
    """``flat`` cut into each rank's part: equal, or ``sizes[r]`` elements for rank r."""
    if sizes is None:
        return list(flat.view(world_size(group), -1))
    return list(flat.split(sizes))


def _take_slice(
    output: torch.Tensor, summed: torch.Tensor, sizes: list[int] | None, group: ProcessGroup
) -> None:
    """gloo's reduce-scatter, at its wait: this rank's slice of the in-place sum, then the
    sum's storage freed (see ``reduce_scatter_flat``)."""
    output.copy_(_rows(summed, sizes, group)[rank(group)])
    summed.untyped_storage().resize_(0)


def _on_gloo(group: ProcessGroup, device: torch.device) -> bool:
    """Whether a collective on ``group`` over a tensor on ``device`` runs on gloo."""
    return device.type == "cpu" and "gloo" in _backend(group)


def _on_nccl(group: ProcessGroup, device: torch.device) -> bool:
    """Whether it runs on NCCL, whose list forms take per-rank sizes that differ (other
    backends -- gloo, torch's fake process group -- get broadcasts or an all-reduce)."""
    return device.type == "cuda" and "nccl" in _backend(group)


def _backend(group: ProcessGroup) -> str:
    state = group_state(group)
    if state.backend is None:
        state.backend = dist.get_backend(group)
    return state.backend


def _gather_by_broadcasts(
    rows: list[torch.Tensor], shard: torch.Tensor, group: ProcessGroup
) -> _Works:
    """gloo: an all-gather as one broadcast per rank, each straight into its rank's row
    of the output (empty rows skipped). gloo's own all-gather fills a flat buffer of its
    own (the size of the output) and copies it out, freed on its worker thread: memory
    beside every gather, and a peak that depends on thread timing. The same bytes cross
    the wire either way."""
    rows[rank(group)].copy_(shard)
    return _Works(
        [
            dist.broadcast(row, src=dist.get_global_rank(group, r), group=group, async_op=True)
            for r, row in enumerate(rows)
            if row.numel()
        ]
    )


class _Works:
    """Several c10d works waited for as one (``Work.wait``'s signature)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        return True


def reduce_scatter_flat(
    output: torch.Tensor,
    full: torch.Tensor,
    group: ProcessGroup,
    *,
    tag: Tag | None = None,
    sizes: list[int] | None = None,
) -> Handle:
    """Sum ``full`` over ranks and leave rank r's contiguous 1/W slice in ``output`` (or,
    with ``sizes``, its ``sizes[r]`` elements after those of lower ranks).

    Worked example, W=2, each rank holding full = [a0, a1, a2, a3] / [b0, b1, b2, b3]:
    rank 0 ends with [a0+b0, a1+b1], rank 1 with [a2+b2, a3+b3]. Asynchronous: ``output``
    is valid only after the returned handle's ``wait()``; keep ``full`` alive until then.
    ``full`` is the caller's temporary and is consumed: on gloo its storage is freed once
    the reduction is waited for.

    Gloo has no reduce-scatter of its own: torch's clones the input and all-reduces the
    clone. Here the all-reduce runs in place on ``full``, which moves the same bytes
    without the clone, and ``output`` takes this rank's slice at the wait. The storage is
    then freed here, on this thread: gloo's worker drops its own reference to the work a
    moment after completing it, and were its the last, the memory would be freed there,
    at a point that depends on thread timing.
    """
    device = _begin("reduce_scatter", tag, full, group, output.device)
    if device is None:
        output.copy_(full)
        return Handle(None, tag, output.device)
    staged = _staged(full, device)
    if _on_gloo(group, device) or (sizes is not None and not _on_nccl(group, device)):
        with _peer_errors("reduce_scatter", tag):
            work = dist.all_reduce(staged, group=group, async_op=True)
        take = functools.partial(_take_slice, output, staged, sizes, group)
        return Handle(work, tag, device, group, take)
    out = output if output.device == device else torch.empty_like(output, device=device)
    with _peer_errors("reduce_scatter", tag):
        if sizes is not None:  # a grouped reduce per rank
            parts = _rows(staged, sizes, group)
            work = dist.reduce_scatter(out, parts, group=group, async_op=True)
        else:
            work = _reduce_scatter_flat(out, staged, group=group, async_op=True)
    return Handle(work, tag, device, group, _copy_back(output, out))


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup,
    op: str = "sum",
    *,
    kind: str = "all_reduce",
    tag: Tag | None = None,
    async_op: bool = False,
) -> Handle | None:
    """In-place all-reduce with ``op`` in {"sum", "max"}; counted under ``kind``. With
    ``async_op``, the Handle to wait on (None where nothing was issued: world size 1).

    ``"max"`` counts a NaN as +inf on every backend: NCCL's float max is ``fmax``, which
    drops a NaN unless every rank has one, so a NaN on one rank (a gradient norm, a
    replica's fingerprint) would come back finite."""
    device = _begin("all_reduce", tag, tensor, group, tensor.device, kind)
    if device is None:
        return None
    staged = _staged(tensor, device)
    if op == "max" and staged.is_floating_point():
        staged.nan_to_num_(nan=math.inf, posinf=math.inf, neginf=-math.inf)
    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    with _peer_errors(kind, tag):
        work = dist.all_reduce(staged, op=reduce_op, group=group, async_op=True)
    handle = Handle(work, tag, device, group, _copy_back(tensor, staged))
    if async_op:
        return handle
    handle.wait()
    return None


def differ_across(
    tensors: list[torch.Tensor],
    groups: list[ProcessGroup],
    device: torch.device,
    tag: Tag | None = None,
) -> torch.Tensor:
    """Per tensor, whether its value differs between the ranks of ``groups`` (bool, shape
    ``(len(tensors),)``): three float64 fingerprints of each (sum, sum of squares, a ramp-
    weighted sum) and their negations, max-all-reduced in one small collective per group.
    For checks made once (replicas that must start equal), not for the step."""
    comm = comm_device(groups[0], device)
    prints = []
    for t in tensors:
        v = t.detach().reshape(-1).to(comm, torch.float64)
        ramp = torch.linspace(1.0, 2.0, v.numel(), dtype=torch.float64, device=comm)
        prints.append(torch.stack([v.sum(), (v * v).sum(), (v * ramp).sum()]))
    mine = torch.stack(prints)  # (len(tensors), 3)
    both = torch.cat([mine, -mine])
    for group in groups:
        all_reduce(both, group, op="max", kind="replica_check", tag=tag)
    return (both[: len(tensors)] != -both[len(tensors) :]).any(dim=1)


def broadcast_from_first(
    tensor: torch.Tensor, groups: list[ProcessGroup | None], tag: Tag | None = None
) -> None:
    """Make ``tensor`` equal on all ranks of the given groups (their first rank's value);
    with (replicate, shard) groups, every rank ends with global rank 0's value."""
    for group in groups:
        if group is not None:
            broadcast(tensor, group, tag=tag)


def broadcast(
    tensor: torch.Tensor, group: ProcessGroup, src_rank: int = 0, *, tag: Tag | None = None
) -> None:
    """In-place broadcast from the group's rank ``src_rank``."""
    device = _begin("broadcast", tag, tensor, group, tensor.device)
    if device is None:
        return
    staged = _staged(tensor, device)
    src = dist.get_global_rank(group, src_rank)
    with _peer_errors("broadcast", tag):
        work = dist.broadcast(staged, src=src, group=group, async_op=True)
    Handle(work, tag, device, group, _copy_back(tensor, staged)).wait()


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


def group_timeout(group: ProcessGroup) -> float:
    """The group's collective timeout in seconds (what a hung collective would wait, and
    after which NCCL's watchdog aborts): its first backend's that says (CUDA first)."""
    types = sorted({d.type for d in getattr(group, "_device_types", [])}, key=lambda t: t != "cuda")
    for device_type in types or ["cpu"]:
        try:
            return group._get_backend(torch.device(device_type)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            continue
    return dist.default_pg_timeout.total_seconds()


def global_ranks(group: ProcessGroup) -> list[int]:
    """The global rank of each of ``group``'s ranks, in group rank order (no communication)."""
    return [dist.get_global_rank(group, r) for r in range(world_size(group))]


def store() -> Any:
    """The default process group's store (the divergence check's rendezvous and
    post-mortem)."""
    return dist.distributed_c10d._get_default_store()


def global_rank() -> int:
    return dist.get_rank()


def gather_ints(
    mine: torch.Tensor, group: ProcessGroup, what: str, tag: Tag | None
) -> torch.Tensor:
    """Every rank's ``mine`` (a small int64 tensor on the group's device), concatenated in
    rank order: the divergence check's lockstep compare for a collective ``tag`` issues,
    itself issued as is (not checked) and counted in ``tag``'s ledger."""
    everyone = torch.empty(world_size(group) * mine.numel(), dtype=mine.dtype, device=mine.device)
    if tag is not None:
        tag.ledger.collective("divergence_check", everyone, tag.name)
    with _peer_errors(what, tag):
        _all_gather_flat(everyone, mine, group=group)
    return everyone
