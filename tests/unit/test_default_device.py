"""``devices.default_device`` picks the device the user meant, or says it cannot tell.

CUDA is faked on this CPU machine: ``torch.cuda.is_available``, ``current_device`` and
``device_count`` and the ``LOCAL_RANK`` variable are patched per test (pytest's
``monkeypatch`` restores them).
"""

from __future__ import annotations

import re

import pytest
import torch

from fsdp_lite.core.devices import default_device


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch):
    """``fake_cuda(current, visible, local_rank)``: CUDA available with ``visible`` devices,
    ``current`` the current one; ``local_rank`` None unsets LOCAL_RANK."""

    def fake(current: int, visible: int, local_rank: int | None) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))

    return fake


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (torch.device("cuda", 3), torch.device("cuda", 3)),
        ("cuda:2", torch.device("cuda", 2)),
        (5, torch.device("cuda", 5)),
        ("cuda", torch.device("cuda", 6)),  # no index: the current device
        ("cpu", torch.device("cpu")),
    ],
)
def test_given_device_wins(fake_cuda, monkeypatch, given, expected) -> None:
    fake_cuda(current=6, visible=8, local_rank=1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert default_device(given, world_size=8) == expected


def test_a_given_cuda_device_is_made_current(fake_cuda, monkeypatch) -> None:
    fake_cuda(current=0, visible=8, local_rank=None)  # set_device never called
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    assert default_device("cuda:3", world_size=8) == torch.device("cuda", 3)
    assert made_current == [torch.device("cuda", 3)]
    for already_current in ("cuda", 0, "cpu"):
        made_current.clear()
        default_device(already_current, world_size=8)
        assert made_current == [], already_current


def test_cpu_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert default_device(None, world_size=8) == torch.device("cpu")


def test_current_device_set_by_the_user_wins_over_local_rank(fake_cuda) -> None:
    fake_cuda(current=5, visible=8, local_rank=1)
    assert default_device(None, world_size=8) == torch.device("cuda", 5)


def test_only_visible_device_is_the_current_one(fake_cuda) -> None:
    fake_cuda(current=0, visible=1, local_rank=None)  # e.g. srun with one GPU per task
    assert default_device(None, world_size=8) == torch.device("cuda", 0)


def test_world_size_one_uses_the_current_device(fake_cuda) -> None:
    fake_cuda(current=0, visible=8, local_rank=None)
    assert default_device(None, world_size=1) == torch.device("cuda", 0)


def test_world_size_defaults_to_the_process_group(fake_cuda, world1) -> None:
    fake_cuda(current=0, visible=8, local_rank=None)
    assert default_device(None) == torch.device("cuda", 0)


def test_local_rank_when_the_current_device_is_ambiguous(fake_cuda, monkeypatch) -> None:
    fake_cuda(current=0, visible=8, local_rank=3)
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    assert default_device(None, world_size=16) == torch.device("cuda", 3)
    assert made_current == [3]  # else every rank's object collectives would use GPU 0


def test_no_set_device_and_no_local_rank_is_an_error(fake_cuda) -> None:
    fake_cuda(current=0, visible=8, local_rank=None)  # e.g. srun, set_device never called
    message = (
        "fsdp_lite cannot tell which GPU this rank should use: 8 GPUs are visible, the world "
        "size is 16, the current CUDA device is 0 (torch's default, maybe never set) and "
        "LOCAL_RANK is not set (launched without torchrun, e.g. by srun?). Call "
        "torch.cuda.set_device(local_rank) before wrapping (under srun local_rank = "
        "int(os.environ['SLURM_LOCALID'])), or pass device= to FSDPModule."
    )
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$") as raised:
        default_device(None, world_size=16)
    assert type(raised.value) is RuntimeError
