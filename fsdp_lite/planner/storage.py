"""Live storage bytes over time, under a ``TorchDispatchMode``, for fake or real tensors.

Every op's outputs are followed by storage: a storage counts from the op that made it until
its last tensor is gone (autograd's saved tensors and buffered gradients included: a weak
reference on the storage fires when the last one drops). Views share their base's storage
and count once. Each storage has a category, which can be changed later (``tag``); points of
interest are recorded as ``Mark``s, and ``marks()`` turns the event list into the bytes per
category at each mark and at the highest point between it and the next.

One allocation no output shows is modelled too: a matrix multiply whose operand BLAS cannot
read in place (an expanded gradient, e.g. of ``loss = out.sum()``: stride 0) copies it to a
contiguous buffer inside the CPU and CUDA kernels, for the length of the op.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

ACTIVATIONS = "activations"
FULL_GRADIENTS = "full_gradients"
BACKWARD_TEMPORARIES = "backward_temporaries"
CATEGORIES = (ACTIVATIONS, FULL_GRADIENTS, BACKWARD_TEMPORARIES)
UNTRACED = "untraced"  # followed but not counted (full buffers: the replay counts them)


@dataclass
class Mark:
    """A point of the step: ``kind`` is pre_forward, post_forward, pre_backward (each time a
    unit's output gradient arrives or a recompute enters it), post_backward (per trainable
    flat param, ``flat`` its index) or end (backward has returned)."""

    kind: str
    unit: int
    flat: int = -1
    at: dict[str, int] = field(default_factory=dict)  # traced bytes at this point
    # traced bytes at the highest point between this mark and the next
    peak_after: dict[str, int] = field(default_factory=dict)


class StorageTracker(TorchDispatchMode):
    """Follows every storage an op returns, from allocation to its last reference."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = ACTIVATIONS  # the category of storages made now
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (ref, serial)
        self.sizes: list[int] = []  # by serial
        self.categories: list[str] = []  # by serial, final
        self.events: list[tuple[int, int] | Mark] = []  # (serial, +1 or -1) or a Mark

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        copies = _blas_copies(func, args)
        if copies:  # made and freed inside the kernel, around its output
            serial = self._transient(copies)
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t, self.phase)
        if copies:
            self.events.append((serial, -1))
        return out

    def _transient(self, nbytes: int) -> int:
        serial = len(self.sizes)
        self.sizes.append(nbytes)
        self.categories.append(self.phase)
        self.events.append((serial, 1))
        return serial

    def track(self, t: torch.Tensor, category: str) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        serial = len(self.sizes)
        self.sizes.append(storage.nbytes())
        self.categories.append(category)
        ref = weakref.ref(storage, functools.partial(self._freed, key, serial))
        self._live[key] = (ref, serial)
        self.events.append((serial, 1))

    def _freed(self, key: int, serial: int, _ref: weakref.ref) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[1] == serial:
            del self._live[key]
        self.events.append((serial, -1))

    def tag(self, t: torch.Tensor, category: str) -> None:
        """Count ``t``'s storage under ``category`` for its whole life."""
        entry = self._live.get(id(t.untyped_storage()))
        if entry is not None and self.categories[entry[1]] != UNTRACED:
            self.categories[entry[1]] = category

    def mark(self, kind: str, unit: int, flat: int = -1) -> None:
        self.events.append(Mark(kind, unit, flat))

    def marks(self) -> list[Mark]:
        """The marks, each with the traced bytes at it and at the highest point after it."""
        level = dict.fromkeys(CATEGORIES, 0)
        marks: list[Mark] = []
        best = -1
        for event in self.events:
            if isinstance(event, Mark):
                event.at = dict(level)
                event.peak_after = dict(level)
                best = sum(level.values())
                marks.append(event)
                continue
            serial, sign = event
            category = self.categories[serial]
            if category == UNTRACED:
                continue
            level[category] += sign * self.sizes[serial]
            total = sum(level.values())
            if marks and total > best:
                best = total
                marks[-1].peak_after = dict(level)
        return marks


_MATMULS = {"aten::mm": (0, 1), "aten::addmm": (1, 2)}  # op -> positions of the matrices


def _blas_copies(func: Any, args: tuple) -> int:
    """Bytes a matrix multiply copies its operands into first: BLAS takes a matrix whose
    elements are contiguous along one dimension with the other's stride at least that
    dimension's size; any other layout (an expanded gradient, e.g. of ``loss = out.sum()``,
    has stride 0) is cloned to a contiguous one inside the CPU and CUDA kernels."""
    where = _MATMULS.get(func._schema.name)
    if where is None:
        return 0
    total = 0
    for i in where:
        m = args[i]
        if isinstance(m, torch.Tensor) and m.dim() == 2 and not _blas_layout(m):
            total += m.numel() * m.element_size()
    return total


def _blas_layout(m: torch.Tensor) -> bool:
    (rows, cols), (s0, s1) = m.shape, m.stride()
    return (s0 == 1 and s1 >= max(1, rows)) or (s1 == 1 and s0 >= max(1, cols))
