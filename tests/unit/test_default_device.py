"""``devices.default_device`` picks the device the user meant, or says it cannot tell.

CUDA is faked on this CPU machine: ``torch.cuda.is_available``, ``current_device``,
``device_count`` and ``set_device`` and the launchers' local-rank variables are patched
per test (pytest's ``monkeypatch`` restores them).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fsdp_lite.core.devices import LOCAL_RANK_VARIABLES, default_device


class FakeCuda:
    """CUDA with ``visible`` devices and a current one that ``set_device`` changes (each
    call recorded in ``made_current``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, current: int, visible: int) -> None:
        self.current, self.made_current = current, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)

    def set_device(self, device: torch.device | int) -> None:
        self.made_current.append(device)
        self.current = device if isinstance(device, int) else torch.device(device).index


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch):
    """``fake_cuda(current, visible, local_rank, variable="LOCAL_RANK")``: a
    :class:`FakeCuda`, every launcher's local-rank variable unset but ``variable``, set
    to ``local_rank`` unless that is None."""

    def fake(
        current: int, visible: int, local_rank: int | None, variable: str = "LOCAL_RANK"
    ) -> FakeCuda:
        for name in LOCAL_RANK_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        if local_rank is not None:
            monkeypatch.setenv(variable, str(local_rank))
        return FakeCuda(monkeypatch, current, visible)

    return fake


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (torch.device("cuda", 3), torch.device("cuda", 3)),
        ("cuda:2", torch.device("cuda", 2)),
        (5, torch.device("cuda", 5)),
        ("cuda", torch.device("cuda", 6)),  # no index: the current device, set by the user
        ("cpu", torch.device("cpu")),
    ],
    ids=["device", "str", "int", "bare", "cpu"],
)
def test_given_device_wins(fake_cuda, given, expected) -> None:
    fake_cuda(current=6, visible=8, local_rank=1)
    assert default_device(given, world_size=8) == expected


def test_a_given_cuda_device_is_made_current(fake_cuda) -> None:
    cuda = fake_cuda(current=0, visible=8, local_rank=None)  # set_device never called
    assert default_device("cuda:3", world_size=8) == torch.device("cuda", 3)
    assert cuda.made_current == [torch.device("cuda", 3)]
    for already_current in ("cuda:3", 3, "cpu"):
        cuda.made_current.clear()
        default_device(already_current, world_size=8)
        assert cuda.made_current == [], already_current


@pytest.mark.parametrize(
    "given", [None, "cuda", torch.device("cuda")], ids=["none", "bare-str", "bare-device"]
)
def test_cuda_without_an_index_is_this_ranks_gpu(fake_cuda, given) -> None:
    # torchrun, W=8 on one node, set_device never called: a bare "cuda" used to be the
    # current device, GPU 0 on every rank.
    cuda = fake_cuda(current=0, visible=8, local_rank=3)
    assert default_device(given, world_size=8) == torch.device("cuda", 3)
    assert cuda.current == 3  # else every rank's object collectives would use GPU 0


@pytest.mark.parametrize("variable", LOCAL_RANK_VARIABLES)
@pytest.mark.parametrize("local_rank", [0, 5])
def test_each_launchers_local_rank(fake_cuda, variable, local_rank) -> None:
    # srun / mpirun after torch.cuda.set_device(local rank): local rank 0's current device
    # is 0, like a rank that never set one; its launcher's variable says 0 is right.
    cuda = fake_cuda(current=local_rank, visible=8, local_rank=local_rank, variable=variable)
    assert default_device(None, world_size=16) == torch.device("cuda", local_rank)
    assert cuda.current == local_rank


def test_local_rank_beyond_the_visible_gpus_is_an_error(fake_cuda) -> None:
    fake_cuda(current=0, visible=4, local_rank=6, variable="SLURM_LOCALID")
    with pytest.raises(RuntimeError, match="SLURM_LOCALID=6 names a GPU this rank cannot see"):
        default_device(None, world_size=16)


def test_the_default_groups_bound_device(fake_cuda, monkeypatch) -> None:
    cuda = fake_cuda(current=0, visible=8, local_rank=None)
    group = SimpleNamespace(bound_device_id=torch.device("cuda", 2))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: group)
    assert default_device(None, world_size=8) == torch.device("cuda", 2)
    assert cuda.current == 2


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


def test_no_evidence_is_an_error(fake_cuda) -> None:
    fake_cuda(current=0, visible=8, local_rank=None)  # e.g. srun, set_device never called
    message = (
        "fsdp_lite cannot tell which GPU this rank should use: 8 GPUs are visible, the world "
        "size is 16, the current CUDA device is 0 (torch's default, maybe never set), the "
        "default process group is bound to no device, and no launcher's local rank is set "
        "(LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID). Call "
        "torch.cuda.set_device(local_rank) before wrapping, or pass device= to FSDPModule "
        "(or init_process_group(device_id=...))."
    )
    for given in (None, "cuda"):
        with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$") as raised:
            default_device(given, world_size=16)
        assert type(raised.value) is RuntimeError
