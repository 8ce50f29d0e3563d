"""Per-group caches follow the group, not its ``id``; a failed wait keeps the collective's
buffers alive (no process group needed: fake groups and works)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fsdp_lite.core import collectives


class _Group:
    """A process group as ``comm_device`` sees it: a name and the device types it takes."""

    count = 0

    def __init__(self, device_type: str) -> None:
        _Group.count += 1
        self.group_name = f"fake{_Group.count}"
        self._device_types = [torch.device(device_type)]


def test_a_new_group_at_a_reused_id_gets_its_own_device_types(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    nccl_like = _Group("cuda")
    assert collectives.comm_device(nccl_like, torch.device("cpu")) == torch.device("cuda", 0)
    old_id = id(nccl_like)
    del nccl_like
    for _ in range(1000):  # CPython hands a freed object's address to the next of its size
        gloo_like = _Group("cpu")
        if id(gloo_like) == old_id:
            break
    else:
        pytest.skip("the interpreter did not reuse the address")
    assert collectives.comm_device(gloo_like, torch.device("cpu")) == torch.device("cpu")


class _FailingWork:
    """A collective still in flight whose wait fails (a peer timed out)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer  # what a c10d work holds: the tensors it writes

    def wait(self, *args) -> None:
        raise RuntimeError("boom: not a peer failure")


def test_a_failed_wait_keeps_the_works_buffers() -> None:
    buffer = torch.empty(4)
    alive = weakref.ref(buffer)
    handle = collectives.Handle(_FailingWork(buffer), None, torch.device("cpu"))
    del buffer
    with pytest.raises(RuntimeError, match="boom"):
        handle.wait()
    gc.collect()
    assert alive() is not None, "the buffer the collective writes was freed under it"
    assert handle.waited
    handle.wait()  # not waited for twice
