"""Reduce-scatter and all-gather on gloo as one direct exchange between every pair of ranks.

gloo has no reduce-scatter of its own: torch's gloo backend all-reduces a copy of the
whole input and keeps this rank's slice, sending twice the bytes a reduce-scatter needs.
Here every rank posts at once, for every other rank, a send of the chunk that rank owns
and a receive of its own chunk as that rank holds it (2(W-1) messages); on ``wait`` the
received chunks are summed into the output. The all-gather is the same exchange without
the sum: every rank sends its shard to every other rank, straight into the output.

Measured with 3 MiB fp32 buffers on this project's 2-core CPU machine (two interleaved
runs of 30 calls): reduce-scatter at W=2 3.5/3.7 ms for gloo's, 1.0/2.2 ms exchanged; at
W=4 8.6/7.0 against 2.8/2.4. All-gather at W=2 2.0/2.1 against 1.6/1.7; at W=4 3.4/4.0
against 1.8/1.9.

A daemon thread waits for the messages, exchange after exchange in issue order, and sums a
reduce-scatter's chunks as soon as they arrive; ``Exchange.wait(timeout)`` waits for that
thread's word. (gloo's own wait on a message with a timeout closes the connection when
the timeout runs out, and ``collectives.py`` waits in short timeouts to watch for
diverged ranks.)

When every rank of the group is on this host (x86-64 Linux), each exchange goes through
shared memory instead (``shared_ring.py``), with no message at all: a rank copies what its
peers need into its own ring and announces where in the ring's header; the peer, on the
waiting thread, sleeps until the announcement and reads straight from that ring into its
result (the sum in the same order). Nothing is kept past the call but the output: the
input is in the ring already. Payloads over half the ring still go over TCP.

Each exchange's TCP messages carry a tag from a per-group counter, so two exchanges in flight
(a prefetched gather beside a reduce-scatter) never take each other's messages: the
counter advances identically on every rank, since every rank issues the same collectives
in the same order (what ``collectives.GUARD`` checks). Memory over TCP: the input is kept
until the sends are done, and a reduce-scatter holds (W-1) received chunks until its
``wait``.
Used up to ``MAX_RANKS`` ranks (2(W-1) messages per rank per collective); beyond that,
and on any other backend, ``collectives.py`` calls the process group's own collectives.
"""

from __future__ import annotations

import datetime
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fsdp_lite import shared_ring

MAX_RANKS = 8
_TAGS = 1 << 20


class _Group:
    """What this process keeps per process group: its exchange count (the next tag) and
    its ring. Found by the group's name (c10d names groups in creation order, the same on
    every rank, where an id() a dead group left behind could be reused on one rank only),
    and kept only while it is the same group: a group destroyed and made again under the
    same name (``destroy_process_group``, then ``init_process_group``) starts afresh on
    every rank, or the ranks' stale counts would pair different exchanges."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = weakref.ref(group)
        self.sequence = 0
        self.connected = False
        self.ring: shared_ring.Ring | None = None  # None: TCP messages only


_groups: dict[str, _Group] = {}
# What c10d's Work.wait(timeout) raises when the timeout runs out (collectives.py watches
# for it and waits again).
WAIT_TIMED_OUT = "Operation timed out!"


def applies(group: dist.ProcessGroup, tensor: torch.Tensor) -> bool:
    """Whether a collective on ``group`` over ``tensor`` goes through an exchange."""
    size = group.size()
    return (
        1 < size <= MAX_RANKS and tensor.device.type == "cpu" and dist.get_backend(group) == "gloo"
    )


class Exchange:
    """One exchange in flight (its messages, or its ring's parts); ``wait`` behaves as a
    ``Work``'s."""

    def __init__(
        self,
        works: list[Any],
        keep: list[torch.Tensor],
        finish: Callable[[], None] | None = None,
        failed: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._works = works
        self._keep = keep  # what the sends read and the receives write, until done
        self._finish = finish  # the sum of a reduce-scatter, once everything arrived
        self._failed = failed  # told the error, on the waiting thread, if one was raised
        self._done = threading.Event()
        self._error: BaseException | None = None
        _waiter().put(self)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise RuntimeError(WAIT_TIMED_OUT)
        if self._error is not None:
            raise self._error
        return True

    def complete(self) -> None:
        """On the waiting thread: every message, then ``finish`` (the sum of the received
        chunks, or taking the parts from the peers' rings)."""
        try:
            for work in self._works:
                work.wait()
            if self._finish is not None:
                self._finish()
        except BaseException as e:  # handed to the caller of wait()
            self._error = e
        finally:
            self._works, self._keep, self._finish = [], [], None
            self._done.set()
        if self._error is not None and self._failed is not None:
            self._failed(self._error)


_queue: queue.SimpleQueue | None = None


def _waiter() -> queue.SimpleQueue:
    """The queue of the thread that waits for every exchange, started on first use."""
    global _queue
    if _queue is None:
        _queue = queue.SimpleQueue()
        thread = threading.Thread(target=_wait_forever, args=(_queue,), daemon=True)
        thread.name = "fsdp_lite-exchange"
        thread.start()
    return _queue


def _wait_forever(pending: queue.SimpleQueue) -> None:
    while True:
        pending.get().complete()


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    stalled: Callable[[], None] | None = None,
) -> Exchange:
    """Sum ``full`` over ``group`` and leave this rank's contiguous 1/W slice in ``output``.

    The sum is this rank's chunk, then every other rank's in rank order, through a ring
    or not. ``stalled``: called while waiting for room in the ring (``Ring.stage``).
    """
    size, me = group.size(), group.rank()
    _check_sizes("reduce_scatter", output, full, size)
    chunks = full.view(size, -1)
    peers = [p for p in range(size) if p != me]
    ring = _ring(group)
    if ring is not None and ring.fits(chunks[0].nbytes, len(peers)):
        output.copy_(chunks[me])  # ``full`` is not needed past this call
        staged = [chunks[p] for p in peers]
        add = lambda i, src: output.add_(src)  # noqa: E731
        return _through_ring(ring, "reduce_scatter", peers, staged, add, output, stalled)
    received = torch.empty((size - 1, chunks.shape[1]), dtype=full.dtype, device=full.device)
    ops = []
    for i, peer in enumerate(peers):
        ops += [(dist.isend, chunks[peer], peer), (dist.irecv, received[i], peer)]
    works = _issue(ops, group)

    def finish() -> None:
        torch.add(chunks[me], received[0], out=output)
        for more in received[1:]:
            output.add_(more)

    return Exchange(works, [full, received], finish)


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    stalled: Callable[[], None] | None = None,
) -> Exchange:
    """Every rank's equal-sized ``shard`` into ``output``, in rank order."""
    size, me = group.size(), group.rank()
    _check_sizes("all_gather", shard, output, size)
    chunks = output.view(size, -1)
    chunks[me].copy_(shard)
    peers = [p for p in range(size) if p != me]
    ring = _ring(group)
    if ring is not None and ring.fits(shard.nbytes, 1):
        # One copy in the ring, read by every peer.
        take = lambda i, src: chunks[peers[i]].copy_(src)  # noqa: E731
        return _through_ring(ring, "all_gather", peers, [shard], take, output, stalled)
    ops = []
    for peer in peers:
        ops += [(dist.isend, shard, peer), (dist.irecv, chunks[peer], peer)]
    return Exchange(_issue(ops, group), [shard, output])


def _through_ring(
    ring: shared_ring.Ring,
    kind: str,
    peers: list[int],
    staged: list[torch.Tensor],
    take: Callable[[int, torch.Tensor], Any],
    output: torch.Tensor,
    stalled: Callable[[], None] | None,
) -> Exchange:
    """An exchange of ``kind`` through ``ring`` with ``peers`` (group ranks, ascending):
    ``staged`` (one tensor for every peer, or one per peer in that order) copied in and
    announced; ``take(i, part)`` with the i-th peer's part for this rank, read from that
    peer's ring once announced there.

    No message: every rank stages exactly one region per exchange through the ring, so
    this exchange is region ``number`` in every rank's ring, and peer p's part for this
    rank is its only one, or the one at this rank's place among p's peers. Taking it is
    reported to p as ``number`` (``Ring.taken``); p writes there again once every peer
    has reported.
    """
    number = ring.stage(kind, staged, stalled)
    numel, dtype, parts, me = staged[0].numel(), staged[0].dtype, len(staged), ring.me

    def finish() -> None:
        for i, peer in enumerate(peers):
            index = 0 if parts == 1 else me - (me > peer)
            take(i, ring.part(peer, number, kind, parts, index, numel, dtype))
            ring.taken(peer, number)

    # A failed exchange: peers may never take their parts, so no room may ever come.
    return Exchange([], [output], finish, ring.fail)


def ring_tensors() -> list[torch.Tensor]:
    """Every ring this process has mapped, as tensors: memory that lives as long as the
    process. Pass them to ``MemTracker.track_external``, or it counts a ring's 16 MiB as
    allocated by whatever first touches a view of it while tracking."""
    return [t for g in _groups.values() if g.ring is not None for t in g.ring.tensors()]


def _state(group: dist.ProcessGroup) -> _Group:
    key = group.group_name
    state = _groups.get(key)
    if state is None or state.group() is not group:
        if state is not None and state.ring is not None:  # its waiting exchanges give up
            state.ring.fail(RuntimeError(f"process group '{key}' was destroyed"))
        state = _groups[key] = _Group(group)
    return state


def _ring(group: dist.ProcessGroup) -> shared_ring.Ring | None:
    """The group's ring, set up (by every rank together) at its first exchange."""
    state = _state(group)
    if not state.connected:
        state.ring = _connect(group, shared_ring.RING_BYTES)
        state.connected = True
    return state.ring


def _connect(group: dist.ProcessGroup, capacity: int) -> shared_ring.Ring | None:
    """Every rank of ``group`` at once: a ring each, mapped by all, or ``None`` for all.
    Each rank fills its own row of everyone's ring names, summed over the group; then the
    ranks agree whether all of them mapped every peer's."""
    me, name = group.rank(), shared_ring.new_name()
    mine = shared_ring.create(name, capacity)
    opened = None
    try:
        rows = torch.zeros((group.size(), shared_ring.NAME_BYTES + 1), dtype=torch.int64)
        rows[me] = shared_ring.encode(name if mine is not None else "", capacity)
        dist.all_reduce(rows, group=group)
        names = [shared_ring.decode(row, capacity) for row in rows]
        opened = shared_ring.open_peers(names, capacity, me)
        agreed = torch.tensor([int(mine is not None and opened is not None)], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    finally:
        if mine is not None:
            shared_ring.unlink(name)
    if not agreed.item():
        shared_ring.close(mine, opened[0] if opened is not None else None)
        return None
    assert mine is not None and opened is not None
    peers, processes = opened
    return shared_ring.Ring(mine, peers, me, processes, group_timeout(group))


def group_timeout(group: dist.ProcessGroup) -> float:
    """The group's collective timeout in seconds (what a hung collective would wait, and
    after which NCCL's watchdog aborts): its first backend's that says (CUDA first)."""
    types = sorted({d.type for d in getattr(group, "_device_types", [])}, key=lambda t: t != "cuda")
    for device_type in types or ["cpu"]:
        try:
            return group._get_backend(torch.device(device_type)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            continue
    return dist.default_pg_timeout.total_seconds()


def _check_sizes(op: str, part: torch.Tensor, whole: torch.Tensor, size: int) -> None:
    """Refused here, before any message, as the process group's collective would be."""
    if part.numel() * size != whole.numel() or part.dtype != whole.dtype:
        raise ValueError(
            f"{op}: {size} ranks need a {tuple(whole.shape)} {whole.dtype} tensor to be "
            f"{size} x the {tuple(part.shape)} {part.dtype} one"
        )
    if not (part.is_contiguous() and whole.is_contiguous()):
        raise ValueError(f"{op}: the tensors must be contiguous")


def _issue(ops: list[tuple], group: dist.ProcessGroup) -> list[Any]:
    """Post ``(isend or irecv, tensor, group rank)`` messages under the next tag."""
    tag = _next_tag(group)
    p2p = [dist.P2POp(fn, t, group=group, tag=tag, group_peer=peer) for fn, t, peer in ops]
    return dist.batch_isend_irecv(p2p)


def _next_tag(group: dist.ProcessGroup) -> int:
    state = _state(group)
    tag, state.sequence = state.sequence, (state.sequence + 1) % _TAGS
    return tag
