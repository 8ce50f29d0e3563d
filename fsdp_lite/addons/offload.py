"""Offload homes for shards and shard grads: CPU memory, or files (the compute device's,
the default, is ``home.DeviceHome``).

Each home is one small class overriding ``DeviceHome``'s methods (listed, with who calls
them, in ``core/home.py``).

[Note: SSD homes are memory-mapped]
An SSD home keeps each shard, shard grad and (optionally) optimizer moment in a file
mapped with ``MAP_SHARED`` and viewed as a tensor (``torch.frombuffer``). The shard
``nn.Parameter`` keeps its identity and the optimizer's in-place updates reach the file
with no copy. After each use the home drops the pages from this process
(``madvise(MADV_DONTNEED)``, safe for shared file mappings: the data stays in the file
and page cache), so between uses they cost no resident memory; the next touch pages
them back in.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fsdp_lite.core import devices
from fsdp_lite.core.home import DeviceHome
from fsdp_lite.core.tree import units_of


@dataclass(frozen=True)
class CPUOffload:
    """fp32 shards and shard grads live in CPU memory; the optimizer steps on CPU.

    Args:
        pin_memory: pin the host buffers when the compute device is CUDA, so copies to
            and from the device run asynchronously.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffload.pin_memory must be a bool, got {self.pin_memory!r}")

    def make_home(self, device: torch.device, rank: int) -> CPUHome:
        return CPUHome(device, pin=self.pin_memory and devices.pins_host_memory(device))


@dataclass(frozen=True)
class SSDOffload:
    """fp32 shards and shard grads live in files under ``path/rank{r}/``, in RAM only while
    a unit uses them. The directory is private (mode 0700) and removed at exit.

    Args:
        path: a directory on a fast local disk; created if missing.
    """

    path: str | os.PathLike

    def __post_init__(self) -> None:
        if not isinstance(self.path, str | os.PathLike) or not str(self.path):
            raise TypeError(f"SSDOffload.path must be a directory path, got {self.path!r}")

    def make_home(self, device: torch.device, rank: int) -> SSDHome:
        """One home per directory while any flat param uses it (units share the files)."""
        directory = (Path(self.path) / f"rank{rank}").resolve()
        home = _SSD_HOMES.get(str(directory))
        if home is None:
            home = _SSD_HOMES[str(directory)] = SSDHome(device, directory)
        return home


class CPUHome(DeviceHome):
    """Shards and grads in (pinned) CPU memory; copies to and from the compute device."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        super().__init__(device)
        self.pin = pin
        self._staged: list[tuple[nn.Parameter, torch.Tensor]] = []  # grads copying to host
        self._uploads: dict[int, object] = {}  # id(shard) -> its last copy's event

    def place(self, shard: nn.Parameter) -> None:
        data = shard.data.to("cpu")
        shard.data = data.pin_memory() if self.pin else data

    def shard_for_gather(self, shard: nn.Parameter) -> torch.Tensor:
        data, self._uploads[id(shard)] = devices.upload(shard.detach(), self.device)
        return data

    def before_host_write(self, shard: nn.Parameter) -> None:
        devices.wait(self._uploads.pop(id(shard), None))

    def end_of_forward(self) -> None:
        # A forward with no backward after it (a validation loss between backward() and
        # opt.step()) leaves uploads that may still read the pinned shards the optimizer
        # writes next. They run on a side stream that waits for no compute, so this blocks
        # the host only until the last of them has been read, not for the forward's compute.
        for event in self._uploads.values():
            devices.wait(event)
        self._uploads.clear()

    def accumulate_grad(self, shard: nn.Parameter, grad: torch.Tensor) -> None:
        if self.device.type == "cpu":
            return super().accumulate_grad(shard, grad)
        host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.pin)
        host.copy_(grad, non_blocking=self.pin)
        self._staged.append((shard, host))  # added once the copy is known to be done

    def end_of_backward(self) -> None:
        # Also with nothing staged: the optimizer writes the host shards next, and
        # non-blocking host-to-device copies of them (gathers) may still be reading.
        devices.synchronize(self.device)
        self._uploads.clear()
        for shard, host in self._staged:
            super().accumulate_grad(shard, host)
        self._staged.clear()


# Process-wide by nature, as the directories are: file names unique in the process, and one
# home per directory while any flat param uses it (a home removes its directory at exit,
# so two homes on one directory would remove each other's files).
_file_ids = itertools.count()
_SSD_HOMES: weakref.WeakValueDictionary[str, SSDHome] = weakref.WeakValueDictionary()


class SSDHome(DeviceHome):
    """Shards, grads and optimizer moments in memory-mapped files under one directory."""

    def __init__(self, device: torch.device, directory: Path) -> None:
        super().__init__(device)
        self.directory = directory
        self._maps: list[mmap.mmap] = []
        self._grads: dict[int, torch.Tensor] = {}  # id(shard) -> file-backed grad buffer
        self._grad_maps: dict[int, mmap.mmap | None] = {}
        self._shard_maps: dict[int, mmap.mmap | None] = {}
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(directory, 0o700)
            probe = directory / ".probe"
            probe.write_bytes(b"0")
            probe.unlink()
        except OSError as e:
            raise RuntimeError(
                f"SSDOffload cannot create its files under {directory}: {e}. Pass a writable "
                "directory on a local disk with room for this rank's shards, grads and "
                "optimizer state"
            ) from e
        _register_cleanup(self, directory)

    def new_tensor(self, like: torch.Tensor) -> tuple[torch.Tensor, mmap.mmap | None]:
        """A zero-filled file-backed tensor shaped like ``like`` (float dtypes); an empty one
        (a rank owning nothing of a whole-params unit) is not backed by a file."""
        if like.numel() == 0:
            return torch.empty(like.shape, dtype=like.dtype), None
        nbytes = like.numel() * like.element_size()
        path = self.directory / f"t{next(_file_ids)}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self._maps.append(mapping)
        tensor = torch.frombuffer(mapping, dtype=like.dtype, count=like.numel())
        return tensor.view(like.shape), mapping

    def place(self, shard: nn.Parameter) -> None:
        data, shard_map = self.new_tensor(shard.data)
        data.copy_(shard.data)
        shard.data = data
        grad, grad_map = self.new_tensor(shard.data)
        self._grads[id(shard)], self._grad_maps[id(shard)] = grad, grad_map
        self._shard_maps[id(shard)] = shard_map
        self.release()

    def shard_for_gather(self, shard: nn.Parameter) -> torch.Tensor:
        return shard.detach().to(self.device)

    def after_gather(self, shard: nn.Parameter) -> None:
        _drop_pages(self._shard_maps[id(shard)])

    def accumulate_grad(self, shard: nn.Parameter, grad: torch.Tensor) -> None:
        if shard.grad is None:  # e.g. after zero_grad(set_to_none=True): reuse the file
            shard.grad = self._grads[id(shard)]
            shard.grad.copy_(grad)
        else:
            shard.grad.add_(grad.to(shard.grad.device))
        _drop_pages(self._grad_maps[id(shard)])

    def release(self) -> None:
        for mapping in self._maps:
            _drop_pages(mapping)


def _drop_pages(mapping: mmap.mmap | None) -> None:
    if mapping is not None:
        mapping.madvise(mmap.MADV_DONTNEED)


def _register_cleanup(home: SSDHome, directory: Path) -> None:
    def cleanup(path: str = str(directory)) -> None:
        shutil.rmtree(path, ignore_errors=True)

    weakref.finalize(home, cleanup)
    atexit.register(cleanup)


def offload_optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Move the optimizer's per-parameter moments (e.g. AdamW's ``exp_avg``/``exp_avg_sq``)
    of SSD-offloaded shards into the same files, after the optimizer's first step, and drop
    every offloaded page after each step. Call once, right after building the optimizer."""
    homes = {
        id(p): flat.home
        for unit in units_of(model)
        for flat in unit.flat_params
        for p in flat.optimizer_params()
    }
    moved: set[int] = set()

    def after_step(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                home = homes.get(id(p))
                if not isinstance(home, SSDHome) or id(p) in moved:
                    continue
                state = opt.state.get(p, {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.shape == p.shape:
                        stored, _ = home.new_tensor(value)
                        stored.copy_(value)
                        state[key] = stored
                moved.add(id(p))
        for home in {id(h): h for h in homes.values()}.values():
            home.release()

    optimizer.register_step_post_hook(after_step)
