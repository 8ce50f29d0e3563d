"""The only module that calls torch.distributed, as torch ships it (c10d's collectives on
gloo or NCCL: no transport of our own).

Everything that talks to other ranks goes through the free functions here, which
take everything they need as arguments. They count calls and bytes per collective
(see ``accounting.py``), short-circuit world size 1 (no communication), and are
the seam tests patch to observe what crosses the wire.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import datetime
import functools
import os
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fsdp_lite.core import accounting

ProcessGroup = dist.ProcessGroup

# torch >= 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DivergenceError(RuntimeError):
    """Ranks were about to issue (or issued) different collectives; raised on every rank."""


class PeerError(RuntimeError):
    """A collective failed because a peer rank died or stopped responding."""


# What a backend raises when a peer is gone or too slow; anything else raised inside a
# collective call (a CPU tensor on an NCCL group, a wrong size) is a local error and
# propagates unchanged.
_PEER_FAILURE_TEXT = ("connection closed by peer", "connection reset", "timed out", "timeout")
_WAIT_TIMED_OUT = "Operation timed out!"  # Work.wait(timeout) ran out; the work goes on


def _is_peer_failure(e: BaseException) -> bool:
    if isinstance(e, dist.DistNetworkError | dist.DistBackendError | dist.DistStoreError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(t in text for t in _PEER_FAILURE_TEXT)


@contextlib.contextmanager
def _peer_errors(op: str, unit: str | None, group: ProcessGroup | None = None) -> Iterator[None]:
    try:
        yield
    except (DivergenceError, PeerError):
        raise
    except RuntimeError as e:
        if not _is_peer_failure(e):
            raise
        what = f"{op} of unit '{unit}'" if unit else op
        # The error path only: a peer that turned off the agreed iterations left its entry
        # in the store (the divergence check's post-mortem, see Note).
        turned = _check(group).post_mortem(group) if group is not None else None
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
        unit: str | None,
        device: torch.device,
        group: ProcessGroup | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        self.work = work
        self.unit = unit
        self.device = device
        self.group = group
        self.after = after
        self.failed: Any = None  # a work whose wait raised, kept with its buffers

    @property
    def waited(self) -> bool:
        return self.work is None

    def wait(self) -> None:
        work = self.work
        if work is None:
            return  # waited for at most once, even if that wait failed
        # Referenced until the wait returns: if it raises while the collective is still in
        # flight, the buffers the work writes must not be freed under it.
        self.failed, self.work = work, None
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)  # the one work.wait() holds
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            with _peer_errors("waiting for a collective", self.unit, self.group):
                work.wait()
            end.record(stream)
            accounting.record_cuda_wait(self.unit, start, end)
        else:
            t0 = time.perf_counter()
            with _peer_errors("waiting for a collective", self.unit, self.group):
                _wait_watching_for_divergence(work, self.group)
            accounting.record_wait(self.unit, time.perf_counter() - t0)
        self.failed = None
        after, self.after = self.after, None  # it may hold the collective's buffers
        if after is not None:
            after()


def _wait_watching_for_divergence(work: Any, group: ProcessGroup | None) -> None:
    """Block until ``work`` is done. Every ``STALL_SECONDS`` still waiting, see whether a
    peer rank opened a divergence check this rank should answer (see the Note below)."""
    if group is None or not _check(group).watching():
        work.wait()
        return
    while True:
        try:
            work.wait(datetime.timedelta(seconds=STALL_SECONDS))
            return
        except RuntimeError as e:
            if str(e) != _WAIT_TIMED_OUT:
                raise
        _check(group).answer_open_check(group)


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


def separate_group(group: ProcessGroup) -> ProcessGroup:
    """A second process group over ``group``'s ranks (one per rank set, cached), for the
    reduce-scatters: one NCCL communicator runs one collective at a time, whatever the
    streams, so a backward prefetch's all-gather would queue behind the previous unit's
    reduce-scatter. Collective over ``group``'s members only (local synchronization)."""
    cache = group_cache(group)
    if "separate" not in cache:
        ranks = dist.get_process_group_ranks(group)
        cache["separate"] = dist.new_group(ranks, use_local_synchronization=True)
    return cache["separate"]


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


def comm_device(group: ProcessGroup, device: torch.device) -> torch.device:
    """Where a collective on ``group`` runs for a tensor on ``device``: that device if the
    group's backend takes it, else the backend's (NCCL takes CUDA tensors only: CPU-offloaded
    shards and CPU state are staged on the current CUDA device)."""
    cache = group_cache(group)
    types = cache.get("device_types")
    if types is None:
        types = cache["device_types"] = {d.type for d in getattr(group, "_device_types", [])}
    if not types or device.type in types:
        return device
    if "cuda" in types:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_cache(group: ProcessGroup) -> dict[str, Any]:
    """What fsdp_lite keeps per process group (its backend, device types, the separate
    reduce-scatter group, ...), held for as long as the group object lives: a group made
    after ``destroy_process_group`` starts empty, even where it reuses a name."""
    cache = _GROUP_CACHES.get(group)
    if cache is None:
        cache = _GROUP_CACHES[group] = {}
    return cache


_GROUP_CACHES: weakref.WeakKeyDictionary[ProcessGroup, dict[str, Any]] = weakref.WeakKeyDictionary()


def forget_in_group_caches(key: str) -> None:
    """Drop ``key`` from every live group's cache."""
    for cache in list(_GROUP_CACHES.values()):
        cache.pop(key, None)


def _staged(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.to(device)


def _copy_back(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None] | None:
    return None if src is dst else lambda: dst.copy_(src)


def _begin(
    op: str,
    unit: str | None,
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
    _check(group).before(op, unit, tensor, group)
    accounting.record_collective(kind or op, tensor, unit)
    return comm_device(group, near)


def all_gather_flat(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup,
    *,
    async_op: bool = False,
    unit: str | None = None,
    sizes: list[int] | None = None,
) -> Handle:
    """Gather every rank's 1-D ``shard`` into ``output`` (rank order): equal-sized, or of
    ``sizes[r]`` elements on rank r (whole-param sharding; some may be 0).

    With ``async_op`` the result is valid only after the returned handle's ``wait()``;
    keep ``shard`` alive until then.
    """
    device = _begin("all_gather", unit, output, group, output.device)
    if device is None:
        output.copy_(shard)
        return Handle(None, unit, output.device)
    out = output if output.device == device else torch.empty_like(output, device=device)
    staged = _staged(shard, device)
    with _peer_errors("all_gather", unit):
        if _on_gloo(group, device) or (sizes is not None and not _on_nccl(group, device)):
            work = _gather_by_broadcasts(_rows(out, sizes, group), staged, group)
        elif sizes is not None:  # NCCL: a grouped broadcast per rank
            work = dist.all_gather(_rows(out, sizes, group), staged, group=group, async_op=True)
        else:
            work = _all_gather_flat(out, staged, group=group, async_op=True)
    handle = Handle(work, unit, device, group, _copy_back(output, out))
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
    cache = group_cache(group)
    backend = cache.get("backend")
    if backend is None:
        backend = cache["backend"] = dist.get_backend(group)
    return backend


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
    unit: str | None = None,
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
    device = _begin("reduce_scatter", unit, full, group, output.device)
    if device is None:
        output.copy_(full)
        return Handle(None, unit, output.device)
    staged = _staged(full, device)
    if _on_gloo(group, device) or (sizes is not None and not _on_nccl(group, device)):
        with _peer_errors("reduce_scatter", unit):
            work = dist.all_reduce(staged, group=group, async_op=True)
        take = functools.partial(_take_slice, output, staged, sizes, group)
        return Handle(work, unit, device, group, take)
    out = output if output.device == device else torch.empty_like(output, device=device)
    with _peer_errors("reduce_scatter", unit):
        if sizes is not None:  # a grouped reduce per rank
            parts = _rows(staged, sizes, group)
            work = dist.reduce_scatter(out, parts, group=group, async_op=True)
        else:
            work = _reduce_scatter_flat(out, staged, group=group, async_op=True)
    return Handle(work, unit, device, group, _copy_back(output, out))


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup,
    op: str = "sum",
    *,
    kind: str = "all_reduce",
    unit: str | None = None,
    async_op: bool = False,
) -> Handle | None:
    """In-place all-reduce with ``op`` in {"sum", "max"}; counted under ``kind``. With
    ``async_op``, the Handle to wait on (None where nothing was issued: world size 1)."""
    device = _begin("all_reduce", unit, tensor, group, tensor.device, kind)
    if device is None:
        return None
    staged = _staged(tensor, device)
    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    with _peer_errors(kind, unit):
        work = dist.all_reduce(staged, op=reduce_op, group=group, async_op=True)
    handle = Handle(work, unit, device, group, _copy_back(tensor, staged))
    if async_op:
        return handle
    handle.wait()
    return None


def broadcast_from_first(tensor: torch.Tensor, groups: list[ProcessGroup | None]) -> None:
    """Make ``tensor`` equal on all ranks of the given groups (their first rank's value);
    with (replicate, shard) groups, every rank ends with global rank 0's value."""
    for group in groups:
        if group is not None:
            broadcast(tensor, group)


def broadcast(tensor: torch.Tensor, group: ProcessGroup, src_rank: int = 0) -> None:
    """In-place broadcast from the group's rank ``src_rank``."""
    device = _begin("broadcast", None, tensor, group, tensor.device)
    if device is None:
        return
    staged = _staged(tensor, device)
    src = dist.get_global_rank(group, src_rank)
    with _peer_errors("broadcast", None):
        work = dist.broadcast(staged, src=src, group=group, async_op=True)
    Handle(work, None, device, group, _copy_back(tensor, staged)).wait()


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


# -- divergence detection ---------------------------------------------------------
# [Note: divergence check]
# Ranks that issue different collectives (a unit skipped or run in another order on some
# ranks) would hang, crash the backend, or -- same-sized units swapped -- silently mix
# parameters. Every collective on a group is an entry (op, unit, element count) of the
# current iteration (from one root forward on the group to the next). "cheap", the default:
#  * Each root keeps, per group, a tree of the iterations every rank agreed on (a trie of
#    entries, with the points where an iteration ended). An iteration that walks a known
#    path -- training steps, two forwards per backward, a validation forward between
#    backward and step, accumulation, decoding, each in any mix -- costs a dict lookup per
#    collective: no communication, no host sync, no store operation.
#  * The first iteration of a root, and the rest of any iteration after an agreed turn, run
#    in lockstep: every collective is compared across the group before it is issued (a
#    small all-gather on the group itself, safe because every rank does it) and added to
#    the tree.
#  * A rank about to leave the tree (an entry, or an end, no agreed iteration had there)
#    does not issue the collective: it posts its entry to the process group's store and
#    waits for every peer's entry at the same (iteration, position). Peers that take the
#    same turn post theirs (data-dependent control flow that every rank takes: they agree,
#    go on in lockstep). A peer that did not turn is blocked in a collective the turning
#    rank never joins: a wait that has not returned after STALL_SECONDS looks for an open
#    check and answers with its own entry. Entries differ: DivergenceError on both, naming
#    units and ranks.
# On NCCL a wait does not block the host, so a peer that did not turn never answers: the
# turning rank raises after the check's timeout (by default half the process group's),
# naming the ranks that did not answer, before the backend's watchdog aborts the peers'
# unmatched collectives; their error then reports the entries posted to the store (the
# post-mortem of _peer_errors). Nothing reads the store in the steady state.
# "thorough": lockstep always. "off": nothing. Set with FSDP_LITE_CHECK or
# set_divergence_check().

CHECK_MODES = ("off", "cheap", "thorough")
STALL_SECONDS = 1.0
_HISTORY = 8  # iterations remembered to answer a late check
_MAX_PATH_NODES = 100_000  # a root's tree is forgotten past this (paths that never repeat)
Entry = tuple[str, str, int]
_END: Entry = ("end of iteration", "-", 0)
_OPS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "broadcast": 4, _END[0]: 5}


class _Settings:
    """The check's mode and timeout for this process (FSDP_LITE_CHECK,
    FSDP_LITE_CHECK_TIMEOUT, set_divergence_check): configuration, not state."""

    def __init__(self) -> None:
        self.mode = os.environ.get("FSDP_LITE_CHECK", "cheap")
        if self.mode not in CHECK_MODES:
            raise ValueError(f"FSDP_LITE_CHECK must be one of {CHECK_MODES}, got {self.mode!r}")
        self.timeout = float(os.environ.get("FSDP_LITE_CHECK_TIMEOUT", 0)) or None


_SETTINGS = _Settings()


class _Path:
    """A node of a root's tree of agreed iterations: the entries seen next, and whether an
    agreed iteration ended here."""

    __slots__ = ("next", "ends")

    def __init__(self) -> None:
        self.next: dict[Entry, _Path] = {}
        self.ends = False


class _Check:
    """One process group's divergence check (see Note), kept in the group's cache."""

    def __init__(self, group: ProcessGroup) -> None:
        self.peers = world_size(group) > 1 and _backend(group) != "fake"
        self.iteration = 0
        self.root: str | None = None  # the root whose forward opened this iteration
        self.log: list[Entry] = []  # this iteration's collectives
        # The last iterations' logs, to answer a check a peer opened in one of them.
        self.history: collections.deque[tuple[int, list[Entry]]] = collections.deque(
            maxlen=_HISTORY
        )
        self.trees: dict[str, _Path] = {}  # per root: its agreed iterations
        self.sizes: dict[str, int] = {}  # per root: nodes in its tree
        self.at = _Path()  # where this iteration is in its root's tree
        self.lockstep = True  # compare every collective across the group before issuing it
        self._answered: set[tuple[int, int]] = set()
        self._my_last_key: str | None = None
        self._busy = False  # the check's own collectives are not checked

    def watching(self) -> bool:
        return _SETTINGS.mode == "cheap" and self.peers

    def before(self, op: str, unit: str | None, tensor: torch.Tensor, group: ProcessGroup) -> None:
        if _SETTINGS.mode == "off" or self._busy or not self.peers:
            return
        entry = (op, unit or "-", tensor.numel())
        position = len(self.log)
        self.log.append(entry)
        known = self.at.next.get(entry)
        if known is not None and not self.lockstep and _SETTINGS.mode == "cheap":
            self.at = known
            return
        if self.lockstep or _SETTINGS.mode == "thorough":
            self._compare_now(entry, position, group, tensor.device)
        else:
            self._rendezvous(entry, position, group)
            self.lockstep = True  # every rank took the same turn: compare the rest now
        self.at = known if known is not None else self._grow(entry)

    def _grow(self, entry: Entry) -> _Path:
        """Add an agreed entry after the current point of the tree."""
        node = self.at.next[entry] = _Path()
        self.sizes[self.root] = self.sizes.get(self.root, 0) + 1
        return node

    def start_iteration(self, root: str, group: ProcessGroup, device: torch.device) -> None:
        """At a root's forward: close the last iteration (a rank that ends where no agreed
        iteration ended checks with its peers first), open the next."""
        if _SETTINGS.mode != "off" and self.peers and self.root is not None:
            if self.lockstep or _SETTINGS.mode == "thorough":
                self._compare_now(_END, len(self.log), group, device)
            elif not self.at.ends:
                self._rendezvous(_END, len(self.log), group)
            self.at.ends = True
        self.history.append((self.iteration, self.log))
        self.log = []
        self.root = root
        self.iteration += 1
        if self.sizes.get(root, 0) > _MAX_PATH_NODES:
            self.trees.pop(root, None)
            self.sizes.pop(root, None)
        tree = self.trees.get(root)
        if tree is None:
            tree = self.trees[root] = _Path()
        self.at = tree
        self.lockstep = not tree.next and not tree.ends

    # -- lockstep: compare on the group itself ---------------------------------------

    def _compare_now(
        self, entry: Entry, position: int, group: ProcessGroup, device: torch.device
    ) -> None:
        device = comm_device(group, device)
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
        raise DivergenceError(_describe(global_ranks(group), entries, self.iteration, position))

    # -- off lockstep: compare through the store -------------------------------------

    def _rendezvous(self, entry: Entry, position: int, group: ProcessGroup) -> None:
        """Post ``entry`` as this rank's at (iteration, position), announce the check, and
        wait for every rank of ``group`` to post theirs; raise if they differ."""
        store, name = _store(), group.group_name
        store.set(f"fsdp_lite/open/{name}", f"{self.iteration}/{position}")
        agreed = [_what(e) for e in list(self.at.next)[:3]] + (["its end"] if self.at.ends else [])
        self._answer(store, group, self.iteration, position, entry, " or ".join(agreed))

    def post_mortem(self, group: ProcessGroup) -> str | None:
        """After a collective on ``group`` failed: what a peer that opened a divergence
        check this rank never answered was about to issue, beside this rank's entry at that
        point (None without such a check, or without a store to ask)."""
        try:
            store = _store()
            key = f"fsdp_lite/open/{group.group_name}"
            if not store.check([key]):
                return None
            iteration, position = (int(x) for x in store.get(key).decode().split("/"))
            if (iteration, position) in self._answered:
                return None  # a check this rank took part in (agreed, or raised then)
            base = f"fsdp_lite/check/{group.group_name}/{iteration}/{position}/"
            posted = {
                r: ast.literal_eval(store.get(base + str(r)).decode())
                for r in global_ranks(group)
                if store.check([base + str(r)])
            }
        except RuntimeError:
            return None
        log = self.log if iteration == self.iteration else None
        log = log or next((lg for i, lg in self.history if i == iteration), None) or []
        posted[dist.get_rank()] = log[position] if position < len(log) else _END
        per_rank = "; ".join(f"rank {r}: {_what(e)}" for r, e in sorted(posted.items()))
        return (
            f"ranks took different paths at collective #{position} of iteration {iteration} "
            f"({per_rank}; what the divergence check found in the store: this rank ran on "
            "along the iterations agreed before, where the others turned). A unit ran on "
            "some ranks but not others, or in a different order: make every rank run the "
            "same units in the same order"
        )

    def answer_open_check(self, group: ProcessGroup) -> None:
        """Called while blocked in a collective: answer a check a peer opened, if any."""
        store = _store()
        key = f"fsdp_lite/open/{group.group_name}"
        if not store.check([key]):
            return
        iteration, position = (int(x) for x in store.get(key).decode().split("/"))
        if (iteration, position) in self._answered:
            return
        if iteration == self.iteration and position < len(self.log):
            mine = self.log[position]
        else:
            log = next((log for i, log in self.history if i == iteration), None)
            if log is None or position > len(log):
                return  # not a point this rank passed (or remembers): nothing to answer
            mine = log[position] if position < len(log) else _END
        self._answer(store, group, iteration, position, mine)

    def _answer(
        self,
        store: Any,
        group: ProcessGroup,
        iteration: int,
        position: int,
        mine: Entry,
        agreed: str = "",
    ) -> None:
        self._answered.add((iteration, position))
        ranks = global_ranks(group)
        base = f"fsdp_lite/check/{group.group_name}/{iteration}/{position}/"
        store.set(base + str(dist.get_rank()), repr(mine))
        keys = [base + str(r) for r in ranks]
        timeout = datetime.timedelta(seconds=_SETTINGS.timeout or group_timeout(group) / 2)
        try:
            store.wait(keys, timeout)
        except RuntimeError as e:
            missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
            raise DivergenceError(
                f"fsdp_lite: rank {dist.get_rank()} was about to issue {_what(mine)} as "
                f"collective #{position} of iteration {iteration}, where the iterations all "
                f"ranks agreed on issued {agreed or 'something else'}; ranks {missing} did "
                f"not reach that point within {timeout.total_seconds():.0f} s. A unit ran on "
                "some ranks but not others: make every rank run the same units"
            ) from e
        entries = [ast.literal_eval(v.decode()) for v in store.multi_get(keys)]
        if self._my_last_key is not None:
            store.delete_key(self._my_last_key)  # every rank is past that check
        self._my_last_key = base + str(dist.get_rank())
        if any(e != mine for e in entries):
            raise DivergenceError(_describe(ranks, entries, iteration, position))


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _what(entry: Entry | None) -> str:
    if entry is None or entry == _END:
        return "nothing (the end of its iteration)"
    return f"{entry[0]} of unit '{entry[1]}' ({entry[2]} elements)"


def _describe(ranks: list[int], entries: list, iteration: int, position: int) -> str:
    per_rank = "; ".join(
        f"rank {r}: {_what(tuple(e))}" for r, e in zip(ranks, entries, strict=True)
    )
    return (
        f"fsdp_lite: ranks were about to issue different collectives as collective #{position} "
        f"of iteration {iteration} ({per_rank}). A unit ran on some ranks but not others, or "
        "in a different order: make every rank run the same units in the same order (no "
        "data-dependent skipping of wrapped modules)"
    )


def _check(group: ProcessGroup) -> _Check:
    cache = group_cache(group)
    check = cache.get("check")
    if check is None:
        check = cache["check"] = _Check(group)
    return check


def start_iteration(root: str, group: ProcessGroup, device: torch.device) -> None:
    """At a root's forward: the divergence check's iteration on ``group`` ends, the next
    (of ``root``) begins (see the Note)."""
    _check(group).start_iteration(root, group, device)


def set_divergence_check(mode: str, *, timeout: float | None = None) -> None:
    """``"cheap"`` (default: no communication in the steady-state step), ``"thorough"``
    (every collective compared across ranks before it is issued) or ``"off"``.
    ``timeout``: seconds a rank that took a different path waits for its peers before
    raising (default: half the process group's timeout)."""
    if mode not in CHECK_MODES:
        raise ValueError(f"divergence check must be one of {CHECK_MODES}, got {mode!r}")
    _SETTINGS.mode = mode
    if timeout is not None:
        _SETTINGS.timeout = timeout
