"""A shared-memory ring per process group, for ``exchange.py`` when every rank is on this host.

Over gloo's TCP, each byte of an exchange is copied twice by the kernel (into the socket,
out of it), in syscalls made on whichever thread sends, and a large message waits for the
receiver to drain the socket. Ranks on one host can do with one copy: a rank stages what
its peers need in its own ring (a file in ``/dev/shm`` that every rank of the group maps)
and announces where in the ring's header; the peer copies (or sums) straight from the ring
into its result, then says so in its own ring's header, after which the region is reused.
No message passes between the ranks: a rank waiting for an announcement sleeps on a futex
in the shared header, which the announcing rank wakes.

Set up once per group, at its first exchange, by every rank of it (two small collectives,
issued by exchange.py; this file calls no collective): each rank creates and maps its ring
and every peer's; if any rank cannot (another host, no
``/dev/shm``, a peer's process it cannot see, not x86-64 Linux, ``FSDP_LITE_SHM_BYTES=0``
on some rank), no rank uses one for that group.
The files are unlinked as soon as every rank has mapped them: past the setup, nothing is
left in ``/dev/shm`` however the processes end.

Announcements, not gloo messages: a tiny gloo send and the receive posted beside it cost
the issuing thread 0.15-0.7 ms each on this project's 2-core machine (13 exchanges per step
of ``make bench-step``'s GPT), against microseconds for a store and a wake. Rings are made
on x86-64 only: the announcement is read after the staged bytes only because x86 keeps a
thread's stores in order (TSO), and Python has no fence to issue elsewhere.

Regions are taken and released in issue order (every exchange is completed in that order
by exchange.py's waiting thread); a payload over half the ring goes over TCP instead, so a
ring never waits for more than the exchanges issued before it.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import os
import platform
import secrets
import struct
import time
from collections.abc import Callable

import torch


def _ring_bytes(default: int = 16 << 20) -> int:
    text = os.environ.get("FSDP_LITE_SHM_BYTES", str(default))
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"FSDP_LITE_SHM_BYTES must be a number of bytes >= 0 (0 turns the shared-memory "
            f"rings off), got {text!r}"
        )
    return value


# Bytes of each rank's ring (resident once used; not tensor memory, so not in the
# allocator's figures), from FSDP_LITE_SHM_BYTES; 0 turns rings off. Each group's first
# exchange sizes its rings with the value it finds here.
RING_BYTES = _ring_bytes()
ALIGN = 64  # every region starts here: any dtype's view of it is aligned
# The ring's header (see Ring): at _TAKEN one int64 per group rank; at _PUBLISHED the
# newest region's number (its low 32 bits are the futex word); at _TABLE, what and where
# each of the last TABLE_ENTRIES regions is: (number, kind, bytes per part, parts, offset
# of each part), kind an index into KINDS plus 1.
HEADER = 16384
_TAKEN, _PUBLISHED, _TABLE, _ENTRY = 0, 512, 1024, 128
TABLE_ENTRIES = 64  # regions in flight at most: a rank this far ahead waits for room
MAX_PARTS = _ENTRY // 8 - 4
KINDS = ("all_gather", "reduce_scatter")
WAIT_SECONDS = 1.0  # how often a waiting rank calls ``stalled`` and looks for its peers
POLL_SECONDS = 1e-4  # how often a rank waiting for room looks again
NAME_BYTES = 64  # a ring file name's room in ``encode``
_SHM_DIR = "/dev/shm"


class Ring:
    """This rank's ring (written) and its peers' (read), with the regions still in use.

    Each region is numbered in issue order from 1; every rank stages one region per
    exchange through its ring, so exchange ``n`` is region ``n`` in every rank's ring.
    ``stage`` copies the parts in, writes where they are into the table entry for ``n``,
    then ``n`` into the published count, and wakes whoever waits on it. A peer waits for
    the count to reach ``n`` (``part``), reads the entry, and, once it has taken its part,
    writes ``n`` into slot ``p`` of its *own* ring's header (``taken``); ``p`` reads it
    there: a region is free again once every peer's slot for this rank has reached its
    number. On x86 a store is not seen before the stores that precede it, nor a load
    done after the loads that follow it.

    ``processes``: each peer's process as (pid, start time), looked for while waiting on
    it (a peer that is gone raises, as a closed connection would); ``timeout``: seconds a
    rank waits for a peer before raising (the process group's).
    """

    def __init__(
        self,
        mine: mmap.mmap,
        peers: dict[int, mmap.mmap],
        me: int,
        processes: dict[int, tuple[int, int]] | None = None,
        timeout: float = float("inf"),
    ) -> None:
        self.capacity = len(mine) - HEADER
        self.me = me
        self._mine_map = mine
        self._peer_maps = peers  # mapped for the process's lifetime
        self._mine = torch.frombuffer(mine, dtype=torch.uint8)
        self._peers = {r: torch.frombuffer(m, dtype=torch.uint8) for r, m in peers.items()}
        self._processes = processes or {}
        self._timeout = timeout
        # (start, end, number) of the regions peers may still read, oldest first.
        self._regions: collections.deque[tuple[int, int, int]] = collections.deque()
        self._head = HEADER  # where the next region is tried first
        self._issued = 0  # regions numbered so far
        self.broken: BaseException | None = None  # a failed exchange: no room, ever

    def tensors(self) -> list[torch.Tensor]:
        """The rings' memory as tensors (this rank's and its peers'), for tools that
        count tensors by storage (torch's MemTracker): it exists from setup on."""
        return [self._mine, *self._peers.values()]

    def fits(self, part_nbytes: int, parts: int) -> bool:
        """Whether ``parts`` parts of ``part_nbytes`` each go through the ring (the same on
        every rank)."""
        return carries(parts * _aligned(part_nbytes), self.capacity)

    def stage(
        self, kind: str, tensors: list[torch.Tensor], stalled: Callable[[], None] | None = None
    ) -> int:
        """Copy ``tensors`` (equal sizes) into one new region and announce it as an exchange
        of ``kind`` (one of ``KINDS``); return its number.

        Waits for room while earlier regions are still read by peers, calling ``stalled``
        every ``WAIT_SECONDS`` of waiting (collectives.py answers divergence checks there).
        """
        assert len(tensors) <= MAX_PARTS and len({t.nbytes for t in tensors}) == 1
        sizes = [_aligned(t.nbytes) for t in tensors]
        start = self._reserve(sum(sizes), stalled)
        self._issued += 1
        number = self._issued
        self._regions.append((start, start + sum(sizes), number))
        self._head = start + sum(sizes)
        offsets = [start + sum(sizes[:i]) for i in range(len(tensors))]
        for t, at in zip(tensors, offsets, strict=True):
            self._mine[at : at + t.nbytes].view(t.dtype).copy_(t.reshape(-1))
        entry = (number, KINDS.index(kind) + 1, tensors[0].nbytes, len(offsets), *offsets)
        struct.pack_into(f"<{len(entry)}q", self._mine_map, _entry_at(number), *entry)
        struct.pack_into("<q", self._mine_map, _PUBLISHED, number)  # after the bytes
        _futex_wake(self._mine.data_ptr() + _PUBLISHED)
        return number

    def part(
        self, peer: int, number: int, kind: str, parts: int, index: int, numel: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        """Group rank ``peer``'s ``index``-th of the ``parts`` parts of its region ``number``,
        an exchange of ``kind``, once announced, as ``numel`` elements of ``dtype``. Raises
        if the peer staged another kind, count or size there: the ranks issued different
        collectives."""
        self._await(peer, number)
        shared = self._peer_maps[peer]
        got, theirs, nbytes, count = struct.unpack_from("<4q", shared, _entry_at(number))
        mine = (KINDS.index(kind) + 1, numel * dtype.itemsize, parts)
        if got != number or (theirs, nbytes, count) != mine:
            raise RuntimeError(
                f"fsdp_lite: group rank {peer} staged {_described(theirs, count, nbytes)} as "
                f"its exchange #{number}, where this rank is in {_described(*mine)}: the "
                "ranks issued different collectives. Make every rank run the same units in "
                "the same order"
            )
        (offset,) = struct.unpack_from("<q", shared, _entry_at(number) + 8 * (4 + index))
        return self._peers[peer][offset : offset + nbytes].view(dtype)

    def taken(self, peer: int, number: int) -> None:
        """This rank has taken its part of ``peer``'s region ``number`` (and every earlier)."""
        struct.pack_into("<q", self._mine_map, _TAKEN + 8 * peer, number)

    def fail(self, error: BaseException) -> None:
        """An exchange failed: peers may never take their parts; waiting for room raises."""
        self.broken = error

    def _await(self, peer: int, number: int) -> None:
        """Until ``peer`` has announced region ``number``, asleep on its published count."""
        shared, address = self._peer_maps[peer], self._peers[peer].data_ptr() + _PUBLISHED
        since = looked = time.monotonic()
        while (published := struct.unpack_from("<q", shared, _PUBLISHED)[0]) < number:
            self._raise_if_broken()
            if time.monotonic() - looked >= WAIT_SECONDS:
                looked = time.monotonic()
                self._look_for(peer, number, since)
            _futex_wait(address, published, WAIT_SECONDS)

    def _reserve(self, nbytes: int, stalled: Callable[[], None] | None) -> int:
        since = looked = time.monotonic()
        while True:
            self._raise_if_broken()
            self._reclaim()
            start = self._free_start(nbytes) if len(self._regions) < TABLE_ENTRIES else None
            if start is not None:
                return start
            time.sleep(POLL_SECONDS)
            if time.monotonic() - looked >= WAIT_SECONDS:
                looked = time.monotonic()
                oldest = self._regions[0][2]
                for peer in self._peers:
                    if self._taken_by(peer) < oldest:
                        self._look_for(peer, oldest, since)
                if stalled is not None:
                    stalled()

    def _raise_if_broken(self) -> None:
        if self.broken is not None:
            raise RuntimeError(
                f"fsdp_lite: an earlier exchange failed: {self.broken}"
            ) from self.broken

    def _look_for(self, peer: int, number: int, since: float) -> None:
        """Waiting on ``peer`` for region ``number`` since ``since``: raise if its process
        is gone or past the timeout."""
        process = self._processes.get(peer)
        if process is not None and _started(process[0]) != process[1]:
            raise RuntimeError(
                f"fsdp_lite: group rank {peer} (process {process[0]}) is gone: connection "
                f"closed by peer while this rank waited for its region #{number}"
            )
        if time.monotonic() - since > self._timeout:
            raise RuntimeError(
                f"fsdp_lite: group rank {peer} did not reach its region #{number} within the "
                f"process group's timeout ({self._timeout:.0f} s): timed out"
            )

    def _reclaim(self) -> None:
        """Forget the oldest regions every peer has taken its part of."""
        while self._regions:
            number = self._regions[0][2]
            if any(self._taken_by(peer) < number for peer in self._peers):
                return
            self._regions.popleft()

    def _taken_by(self, peer: int) -> int:
        return struct.unpack_from("<q", self._peer_maps[peer], _TAKEN + 8 * self.me)[0]

    def _free_start(self, nbytes: int) -> int | None:
        """Where ``nbytes`` fit without touching a region in use: after the newest, else
        from the start (the ring wraps)."""
        if not self._regions:
            self._head = HEADER
        for start in (self._head, HEADER):
            end = start + nbytes
            if end <= HEADER + self.capacity and all(
                e <= start or s >= end for s, e, _ in self._regions
            ):
                return start
        return None


def carries(nbytes: int, capacity: int) -> bool:
    """Whether a ring of ``capacity`` bytes takes a payload of ``nbytes``: at most half of
    it, so that a region never waits for more than the ones issued before it."""
    return nbytes <= capacity // 2


def new_name() -> str:
    """A ring file name no other process uses; it says which process made it, and in
    which pid namespace."""
    return f"fsdp_lite-{os.getpid()}-{_pid_namespace()}-{secrets.token_hex(8)}"


def process_of(name: str) -> tuple[int, int] | None:
    """The process that made the ring ``name`` (``new_name``) as (pid, start time), if
    this process sees it under that pid: it runs, in this pid namespace."""
    _, pid, namespace, _ = name.split("-")
    if int(namespace) != _pid_namespace() or not (started := _started(int(pid))):
        return None
    return int(pid), started


def create(name: str, capacity: int) -> mmap.mmap | None:
    """This rank's ring of ``capacity`` bytes (plus its header), its memory reserved now (a
    full ``/dev/shm`` fails here, not later with a SIGBUS at first touch); ``None`` if it
    cannot be made."""
    path = os.path.join(_SHM_DIR, name)
    if capacity <= 0 or not _FUTEX:  # off, or not Linux on x86-64
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, HEADER + capacity)
        return mmap.mmap(fd, HEADER + capacity)
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    """Once every peer has mapped it (or never will): nothing is left in ``/dev/shm``."""
    os.unlink(os.path.join(_SHM_DIR, name))


def encode(name: str, capacity: int) -> torch.Tensor:
    """A rank's ring name ("" for none) and capacity as one row of int64, for a collective."""
    raw = name.encode().ljust(NAME_BYTES, b"\0")
    assert len(raw) == NAME_BYTES, name
    return torch.tensor([*raw, capacity], dtype=torch.int64)


def decode(row: torch.Tensor, capacity: int) -> str:
    """The name in an ``encode``d row; "" where that rank has none of this capacity."""
    *raw, theirs = row.tolist()
    return bytes(raw).rstrip(b"\0").decode() if theirs == capacity else ""


def open_peers(
    names: list[str], capacity: int, me: int
) -> tuple[dict[int, mmap.mmap], dict[int, tuple[int, int]]] | None:
    """Map every peer's ring and find its process (``Ring`` looks for it while waiting);
    ``None`` if any ring is missing (another host, or none made) or its process is not
    one this process sees (``process_of``)."""
    peers: dict[int, mmap.mmap] = {}
    processes: dict[int, tuple[int, int]] = {}
    for rank, name in enumerate(names):
        if rank == me:
            continue
        try:
            process = process_of(name) if name else None
            if process is None:
                raise FileNotFoundError(name)
            processes[rank] = process
            fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
            try:
                peers[rank] = mmap.mmap(fd, HEADER + capacity)
            finally:
                os.close(fd)
        except OSError:
            close(None, peers)
            return None
    return peers, processes


def close(mine: mmap.mmap | None, peers: dict[int, mmap.mmap] | None) -> None:
    """Unmap rings no ``Ring`` was made of (a group that does without)."""
    for m in [mine, *(peers or {}).values()]:
        if m is not None:
            m.close()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _entry_at(number: int) -> int:
    return _TABLE + _ENTRY * (number % TABLE_ENTRIES)


def _started(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot), or 0 if it does not run (a
    zombie, exited but not yet reaped, does not). A pid reused by a later process gives
    another start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # from the state (field 3) on
    except OSError:
        return 0
    return 0 if fields[0] in (b"Z", b"X") else int(fields[19])


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _described(kind: int, parts: int, nbytes: int) -> str:
    name = KINDS[kind - 1] if 0 < kind <= len(KINDS) else f"kind {kind}"
    return f"an {name} of {parts} part(s) of {nbytes} bytes"


# futex(2) on the published count, through libc's syscall(): x86-64 Linux only, where
# rings are made (see the module's docstring). FUTEX_WAIT and FUTEX_WAKE without
# FUTEX_PRIVATE_FLAG: the word is in memory shared between processes.
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc_syscall() -> Callable[..., int] | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall  # releases the GIL while in it
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    return syscall


_FUTEX = _libc_syscall()


def _futex_wait(address: int, seen: int, seconds: float) -> None:
    """Sleep until woken, at most ``seconds``, unless the 32-bit word at ``address`` no
    longer holds ``seen``'s low 32 bits (then return at once)."""
    if _FUTEX is None:  # no ring is made without it; a test's ring may be
        time.sleep(POLL_SECONDS)
        return
    timeout = _Timespec(int(seconds), int(seconds % 1 * 1e9))
    failed = _FUTEX(_SYS_FUTEX, address, _FUTEX_WAIT, ctypes.c_int(seen & 0xFFFFFFFF).value,
                    ctypes.addressof(timeout), None, 0) == -1  # fmt: skip
    if failed and ctypes.get_errno() not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
        time.sleep(POLL_SECONDS)  # futex refused (a sandbox): poll instead of spinning


def _futex_wake(address: int) -> None:
    """Wake every thread of any process asleep on the word at ``address``."""
    if _FUTEX is not None:
        _FUTEX(_SYS_FUTEX, address, _FUTEX_WAKE, 2**31 - 1, None, None, 0)
