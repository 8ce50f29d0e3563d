"""The shared-memory ring's bookkeeping (fsdp_lite/shared_ring.py), in one process: a
peer's ring is an anonymous mapping this test writes the peer's reports into.

- regions are placed after the newest, wrap to the start, and never overlap one in use;
- a region is reused only once every peer has reported taking it; until then ``stage``
  waits, calling ``stalled`` (where collectives.py answers divergence checks);
- a failed exchange makes a waiting ``stage`` raise instead of waiting for ever;
- what a peer reads at an offset is what was staged there;
- a malformed ``FSDP_LITE_SHM_BYTES`` is refused with what it should be.
"""

from __future__ import annotations

import mmap
import struct

import pytest
import torch

from fsdp_lite import shared_ring

CAPACITY = 4096


def _ring(me: int = 0, peers: tuple[int, ...] = (1, 2)) -> tuple[shared_ring.Ring, dict]:
    size = shared_ring.HEADER + CAPACITY
    peer_maps = {p: mmap.mmap(-1, size) for p in peers}
    return shared_ring.Ring(mmap.mmap(-1, size), peer_maps, me), peer_maps


def _report(peer_map: mmap.mmap, me: int, number: int) -> None:
    """What ``peer`` writes once it has taken region ``number`` of rank ``me``."""
    struct.pack_into("<q", peer_map, 8 * me, number)


def _floats(n: int, value: float) -> torch.Tensor:
    return torch.full((n,), value)


def test_regions_wrap_and_wait_for_every_peer(monkeypatch) -> None:
    monkeypatch.setattr(shared_ring, "POLL_SECONDS", 1e-4)
    monkeypatch.setattr(shared_ring, "WAIT_SECONDS", 1e-3)
    ring, peers = _ring()
    assert ring.fits(CAPACITY // 2) and not ring.fits(CAPACITY // 2 + 1)
    first, (a,) = ring.stage([_floats(400, 1.0)])  # 1600 bytes, a multiple of ALIGN
    second, (b,) = ring.stage([_floats(400, 2.0)])
    assert (first, second) == (1, 2)
    assert a == shared_ring.HEADER and b == a + 1600

    stalls = []

    def stalled() -> None:  # the peers catch up while this rank waits
        stalls.append(1)
        _report(peers[1], 0, 1)
        if len(stalls) >= 3:
            _report(peers[2], 0, 1)  # the last peer to take region 1

    third, (c,) = ring.stage([_floats(400, 3.0)], stalled)
    assert third == 3 and c == shared_ring.HEADER  # wrapped into region 1's room
    assert len(stalls) == 3  # waited until both peers had taken region 1, not one
    view = ring._mine[c : c + 1600].view(torch.float32)
    assert torch.equal(view, _floats(400, 3.0))


def test_peer_view_reads_what_was_staged() -> None:
    ring, peers = _ring(me=1, peers=(0,))
    staged = torch.arange(10, dtype=torch.bfloat16)
    peers[0][shared_ring.HEADER + 64 : shared_ring.HEADER + 84] = staged.view(torch.uint8).numpy()
    got = ring.peer_view(0, shared_ring.HEADER + 64, 10, torch.bfloat16)
    assert torch.equal(got, staged)
    ring.taken(0, 7)  # reported in this rank's own header, slot 0
    assert struct.unpack_from("<q", ring._mine_map, 0)[0] == 7


def test_a_failed_exchange_stops_the_wait(monkeypatch) -> None:
    monkeypatch.setattr(shared_ring, "POLL_SECONDS", 1e-4)
    monkeypatch.setattr(shared_ring, "WAIT_SECONDS", 1e-3)
    ring, _ = _ring()
    ring.stage([_floats(1000, 1.0)])  # 4000 bytes: the ring is full until peers report

    def stalled() -> None:
        ring.fail(RuntimeError("peer 1 closed the connection"))

    with pytest.raises(RuntimeError, match="an earlier exchange failed") as err:
        ring.stage([_floats(20, 1.0)], stalled)  # 128 bytes; 64 are left
    assert "peer 1 closed" in str(err.value.__cause__)


def test_ring_size_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("FSDP_LITE_SHM_BYTES", "0")
    assert shared_ring._ring_bytes() == 0  # rings off
    for bad in ("lots", "-1"):
        monkeypatch.setenv("FSDP_LITE_SHM_BYTES", bad)
        with pytest.raises(ValueError, match="FSDP_LITE_SHM_BYTES must be a number of bytes"):
            shared_ring._ring_bytes()
