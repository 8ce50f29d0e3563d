"""The shared-memory rings (fsdp_lite/shared_ring.py), in one process: W rings on anonymous
shared mappings, each ``Ring`` holding its own and mapping its peers', as W ranks would.

- what a peer reads is what was staged for it (one part for all, or one part per peer);
- a peer waits for the announcement and is woken by it (not by its timeout);
- a part of another size than the reader expects is refused: the ranks diverged;
- regions are placed after the newest, wrap to the start, and never overlap one in use;
- a region is reused only once every peer has reported taking it; until then ``stage``
  waits, calling ``stalled`` (where collectives.py answers divergence checks);
- at most ``TABLE_ENTRIES`` regions are in flight;
- a failed exchange makes a waiting ``stage`` raise; a peer whose process is gone, or one
  that does not come within the timeout, makes a waiting ``part`` raise;
- a malformed ``FSDP_LITE_SHM_BYTES`` is refused with what it should be.
"""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from fsdp_lite import shared_ring

CAPACITY = 4096


def _rings(world: int = 3, **kwargs) -> list[shared_ring.Ring]:
    maps = [mmap.mmap(-1, shared_ring.HEADER + CAPACITY) for _ in range(world)]
    return [
        shared_ring.Ring(maps[r], {p: maps[p] for p in range(world) if p != r}, r, **kwargs)
        for r in range(world)
    ]


def _offsets(ring: shared_ring.Ring, number: int) -> list[int]:
    """Where ``ring``'s region ``number`` put its parts (its table entry)."""
    at = shared_ring._entry_at(number)
    got, _, _, parts = struct.unpack_from("<4q", ring._mine_map, at)
    assert got == number
    return list(struct.unpack_from(f"<{parts}q", ring._mine_map, at + 32))


def _floats(n: int, value: float) -> torch.Tensor:
    return torch.full((n,), value)


def _gathered(reader: shared_ring.Ring, writer: int, number: int, numel: int = 400):
    """``writer``'s part of its all-gather ``number``, as ``reader`` reads it."""
    return reader.part(writer, number, "all_gather", 1, 0, numel, torch.float32)


def _take(reader: shared_ring.Ring, writer: int, number: int) -> torch.Tensor:
    part = _gathered(reader, writer, number).clone()
    reader.taken(writer, number)
    return part


@pytest.fixture
def quick(monkeypatch) -> None:
    monkeypatch.setattr(shared_ring, "POLL_SECONDS", 1e-4)
    monkeypatch.setattr(shared_ring, "WAIT_SECONDS", 1e-3)


def test_part_reads_what_was_staged() -> None:
    rings = _rings()
    shared = torch.arange(10, dtype=torch.bfloat16)
    assert rings[0].stage("all_gather", [shared]) == 1  # one part, read by every peer
    for reader in (1, 2):
        got = rings[reader].part(0, 1, "all_gather", 1, 0, 10, torch.bfloat16)
        assert torch.equal(got, shared)
    one, two = _floats(5, 1.0), _floats(5, 2.0)
    assert rings[1].stage("reduce_scatter", [one, two]) == 1  # a part per peer, in order
    assert torch.equal(rings[0].part(1, 1, "reduce_scatter", 2, 0, 5, torch.float32), one)
    assert torch.equal(rings[2].part(1, 1, "reduce_scatter", 2, 1, 5, torch.float32), two)
    rings[2].taken(1, 1)  # reported in rank 2's own header, in rank 1's slot
    assert struct.unpack_from("<q", rings[2]._mine_map, 8)[0] == 1


def test_part_is_woken_by_the_announcement(monkeypatch) -> None:
    monkeypatch.setattr(shared_ring, "WAIT_SECONDS", 30.0)  # not woken by the timeout
    rings = _rings(2)
    got = []
    reader = threading.Thread(target=lambda: got.append(_take(rings[1], 0, 1)))
    start = time.monotonic()
    reader.start()
    time.sleep(0.05)
    assert not got  # waiting for rank 0 to stage region 1
    rings[0].stage("all_gather", [_floats(400, 7.0)])
    reader.join(timeout=10)
    assert got and torch.equal(got[0], _floats(400, 7.0))
    assert time.monotonic() - start < 10


def test_a_part_of_another_kind_count_or_size_is_refused() -> None:
    rings = _rings(3)
    rings[0].stage("all_gather", [_floats(10, 1.0)])
    rings[0].stage("reduce_scatter", [_floats(10, 1.0), _floats(10, 2.0)])
    refused = "the ranks issued different collectives"
    with pytest.raises(RuntimeError, match=refused):  # another size
        rings[1].part(0, 1, "all_gather", 1, 0, 12, torch.float32)
    with pytest.raises(RuntimeError, match="staged an all_gather of 1 part.*in an reduce_scat"):
        rings[1].part(0, 1, "reduce_scatter", 2, 0, 10, torch.float32)  # another kind
    with pytest.raises(RuntimeError, match=refused):  # another count
        rings[1].part(0, 2, "reduce_scatter", 1, 0, 10, torch.float32)
    assert torch.equal(rings[2].part(0, 2, "reduce_scatter", 2, 1, 10, torch.float32),
                       _floats(10, 2.0))  # fmt: skip


def test_regions_wrap_and_wait_for_every_peer(quick) -> None:
    rings = _rings()
    writer = rings[0]
    assert writer.fits(CAPACITY // 2, 1) and not writer.fits(CAPACITY // 2 + 1, 1)
    assert writer.fits(CAPACITY // 4, 2) and not writer.fits(CAPACITY // 4 - 1, 3)
    assert not writer.fits(4, CAPACITY // 2 // shared_ring.ALIGN + 1)  # parts are aligned
    first = writer.stage("all_gather", [_floats(400, 1.0)])  # 1600 bytes, a multiple of ALIGN
    second = writer.stage("all_gather", [_floats(400, 2.0)])
    assert (first, second) == (1, 2)
    (a,), (b,) = _offsets(writer, 1), _offsets(writer, 2)
    assert a == shared_ring.HEADER and b == a + 1600

    stalls = []

    def stalled() -> None:  # the peers catch up while this rank waits
        stalls.append(1)
        if len(stalls) == 1:
            assert torch.equal(_take(rings[1], 0, 1), _floats(400, 1.0))
        if len(stalls) == 3:
            _take(rings[2], 0, 1)  # the last peer to take region 1

    third = writer.stage("all_gather", [_floats(400, 3.0)], stalled)
    assert third == 3 and _offsets(writer, 3) == [shared_ring.HEADER]  # region 1's room
    assert len(stalls) == 3  # waited until both peers had taken region 1, not one
    assert torch.equal(_take(rings[2], 0, 2), _floats(400, 2.0))  # region 2 is untouched
    assert torch.equal(_take(rings[1], 0, 3), _floats(400, 3.0))


def test_regions_in_flight_are_bounded(quick, monkeypatch) -> None:
    monkeypatch.setattr(shared_ring, "TABLE_ENTRIES", 2)
    rings = _rings(2)
    rings[0].stage("all_gather", [_floats(1, 1.0)])
    rings[0].stage("all_gather", [_floats(1, 2.0)])  # the ring has room; the table has not
    stalls = []

    def stalled() -> None:
        stalls.append(1)
        _gathered(rings[1], 0, 1, numel=1)
        rings[1].taken(0, 1)

    assert rings[0].stage("all_gather", [_floats(1, 3.0)], stalled) == 3
    assert stalls and torch.equal(_gathered(rings[1], 0, 2, numel=1), _floats(1, 2.0))


def test_a_failed_exchange_stops_the_wait(quick) -> None:
    ring = _rings()[0]
    ring.stage("all_gather", [_floats(1000, 1.0)])  # 4000 bytes: full until peers report

    def stalled() -> None:
        ring.fail(RuntimeError("peer 1: connection closed by peer"))

    # The cause's words are in the message: collectives.py tells a gone peer by them.
    with pytest.raises(RuntimeError, match="an earlier exchange failed: peer 1: connection"):
        ring.stage("all_gather", [_floats(20, 1.0)], stalled)  # 128 bytes; 64 are left


def test_a_gone_peer_or_the_timeout_stops_the_wait(quick) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me = (os.getpid(), shared_ring._started(os.getpid()))
    for peer in ((gone.pid, me[1]), (me[0], me[1] - 1)):  # exited; a pid reused since
        reader = _rings(2, processes={0: peer, 1: me})[1]
        with pytest.raises(RuntimeError, match=r"group rank 0 \(process \d+\) is gone"):
            _gathered(reader, 0, 1, numel=10)
    reader = _rings(2, timeout=0.05)[1]
    with pytest.raises(RuntimeError, match="did not reach its region #1 .* timed out"):
        _gathered(reader, 0, 1, numel=10)


def test_a_ring_name_says_whose_it_is() -> None:
    name = shared_ring.new_name()
    assert shared_ring.process_of(name) == (os.getpid(), shared_ring._started(os.getpid()))
    other_namespace = name.split("-")
    other_namespace[2] = str(int(other_namespace[2]) + 1)
    assert shared_ring.process_of("-".join(other_namespace)) is None  # pids mean other things
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert shared_ring.process_of(name.replace(f"-{os.getpid()}-", f"-{gone.pid}-")) is None


def test_ring_size_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("FSDP_LITE_SHM_BYTES", "0")
    assert shared_ring._ring_bytes() == 0  # rings off
    for bad in ("lots", "-1"):
        monkeypatch.setenv("FSDP_LITE_SHM_BYTES", bad)
        with pytest.raises(ValueError, match="FSDP_LITE_SHM_BYTES must be a number of bytes"):
            shared_ring._ring_bytes()
