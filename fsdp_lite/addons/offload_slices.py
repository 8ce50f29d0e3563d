"""OffloadModel's pieces: its slices, the device copies of a loaded slice, the partition of
layers into slices, and RNG state capture for recomputation."""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from fsdp_lite.core import devices


@dataclass(frozen=True)
class Slice:
    index: int
    names: tuple[str, ...]  # the layers' names in the wrapped Sequential
    layers: tuple[nn.Module, ...]

    def params(self) -> list[nn.Parameter]:
        """The slice's master parameters, each once, in a fixed order."""
        return list(nn.ModuleList(self.layers).parameters())


@dataclass
class Resident:
    """One slice's device copies while it is loaded."""

    index: int
    params: dict[int, tuple[nn.Parameter, torch.Tensor]]  # id(master) -> (master, copy)
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]]  # id(master) -> (master, copy)
    per_layer: list[dict[str, torch.Tensor]]  # per layer: name -> copy, for functional_call
    nbytes: dict[int, int]  # id(master) -> the copy's storage bytes while freed


class KeptGraph(NamedTuple):
    """Without checkpointing: one slice's forward graph, kept for backward."""

    resident: Resident  # its parameter copies' storage is freed until backward refills it
    leaves: list[torch.Tensor | None]  # per chunk: the input leaf (None: no input grad)
    outputs: list[torch.Tensor]  # per chunk: the output rooting the chunk's graph


def check_config(model: object, num_slices: int, num_microbatches: int) -> None:
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"OffloadModel wraps an nn.Sequential, got {type(model).__name__}")
    if not isinstance(num_slices, int) or not 1 <= num_slices <= len(model):
        raise ValueError(
            f"num_slices must be between 1 and the number of layers ({len(model)}), "
            f"got {num_slices!r}"
        )
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")


def partition(counts: list[int], n: int) -> list[int]:
    """Boundaries ``[0, ..., len(counts)]`` cutting ``counts`` into ``n`` non-empty runs
    with sums near ``sum / n`` each: each cut goes where the running sum is nearest its
    target, after any parameter-free layers (activations stay with the layer before)."""
    counts = counts if sum(counts) else [1] * len(counts)
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    length, bounds = len(counts), [0]
    for i in range(1, n):
        target, last = prefix[-1] * i / n, length - (n - i)  # last: leave a layer per slice
        hi = bisect.bisect_left(prefix, target)  # first cut reaching the target
        best = max(hi if prefix[hi] - target <= target - prefix[hi - 1] else hi - 1, bounds[-1] + 1)
        while best < last and counts[best] == 0:
            best += 1
        bounds.append(min(best, last))
    return bounds + [length]


def pinned(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_pinned() else t.pin_memory()


@contextlib.contextmanager
def rng_restored(state: devices.RngState, device: torch.device) -> Iterator[None]:
    """Run the body from RNG state ``state``, leaving the generators as they were."""
    forked = [] if device.type == "cpu" else [device]
    with torch.random.fork_rng(devices=forked, device_type=device.type):
        devices.set_rng_state(state, device)
        yield
