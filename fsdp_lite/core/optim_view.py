"""What the optimizer sees of a flat param: its shard, or (optimizer_params 'pieces'
or 'whole') this rank's piece of each original parameter as an ``nn.Parameter`` view of
the shard, whose gradients are folded into the shard grad before an accumulation and
pointed back into it at the end of backward.

Every such parameter carries marks (``shard_ranks``, ``cut_from``) so that code which sees
only parameters -- the optimizer misuse check, the grad scaler -- needs no unit tree.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# Every shard nn.Parameter carries (ranks it is a slice of, replicas its grad is averaged
# over too, the dtype its unit computes in), so code that sees only parameters -- the
# optimizer misuse check, the grad scaler -- tells shards from plain parameters without
# the unit tree.
_SHARD_ATTR = "_fsdp_lite_ranks"
# An orig param of a flat param cut at numel/W (optimizer_params='pieces')
# carries its parameter's shape: on some rank it is, or may be, a partial piece.
_CUT_ATTR = "_fsdp_lite_cut_from"
# A parameter an FSDPModule left unsharded (``ignored_modules`` / ``ignored_params``,
# ``ignored.py``) carries (shard group size, replicas): the ranks its root averages its
# gradient over.
_REPLICATED_ATTR = "_fsdp_lite_replicated"


def mark_shard(p: torch.Tensor, ranks: tuple[int, int], compute_dtype: torch.dtype) -> None:
    """Mark ``p`` as an fsdp_lite shard: ``(shard group size, replicas)`` and the dtype
    its unit computes in."""
    p.__dict__[_SHARD_ATTR] = (*ranks, compute_dtype)


def shard_ranks(p: torch.Tensor) -> tuple[int, int] | None:
    """``(shard group size, replicas)`` if ``p`` is an fsdp_lite shard, else ``None``."""
    mark = p.__dict__.get(_SHARD_ATTR)
    return None if mark is None else mark[:2]


def shard_compute_dtype(p: torch.Tensor) -> torch.dtype | None:
    """The dtype the unit of shard ``p`` computes in (``None``: not a shard)."""
    mark = p.__dict__.get(_SHARD_ATTR)
    return None if mark is None else mark[2]


def mark_replicated(p: torch.Tensor, ranks: tuple[int, int]) -> None:
    """Mark ``p`` as left unsharded by an FSDPModule (an ignored parameter), replicated on
    ``(shard group size, replicas)`` ranks that its root averages the gradient over."""
    p.__dict__[_REPLICATED_ATTR] = ranks


def replicated_ranks(p: torch.Tensor) -> tuple[int, int] | None:
    """``(shard group size, replicas)`` if an FSDPModule left ``p`` unsharded, else ``None``."""
    return p.__dict__.get(_REPLICATED_ATTR)


def unaveraged(params: list[nn.Parameter], modules: Iterator[nn.Module]) -> list[int]:
    """Indices of the trainable ``params`` whose gradients nothing averages across ranks:
    not an fsdp_lite shard, nor an ignored parameter (its root averages it), nor a parameter
    of a ``DistributedDataParallel`` module among ``modules`` (which averages its own). The
    one rule of the forward and optimizer checks."""
    ddp = {
        id(p)
        for m in modules
        if isinstance(m, nn.parallel.DistributedDataParallel)
        for p in m.parameters()
    }
    return [
        i
        for i, p in enumerate(params)
        if p.requires_grad
        and shard_ranks(p) is None
        and replicated_ranks(p) is None
        and id(p) not in ddp
    ]


def cut_from(p: torch.Tensor) -> torch.Size | None:
    """The original shape of ``p`` if it is an orig param of a flat param cut at numel/W
    (optimizer_params='pieces': the same answer on every rank), else None."""
    return p.__dict__.get(_CUT_ATTR)


@dataclass
class OrigParam:
    """One original parameter's piece on this rank, as the optimizer sees it."""

    name: str  # the parameter's name in the unit's module
    slot: int  # its index in the flat param's slots
    at: int  # where the piece starts in the shard
    numel: int
    param: nn.Parameter  # a view of shard[at : at + numel] (its grad: of the shard grad's)
    shape: tuple[int, ...]  # the view's shape
    ptr: int  # where the view's data starts (the shard never moves once placed)


class OrigParams:
    """The optimizer's parameters of one flat param (optimizer_params 'pieces' / 'whole'): one
    ``nn.Parameter`` per piece of an original parameter this rank holds, a view of the
    shard. A whole piece has the parameter's shape; a partial one is 1-D with leading 1s
    up to the parameter's ndim (so ``p.ndim`` sorts parameters into groups). With ``cut``
    (not whole params) every one is marked for ``cut_from``: some rank holds a partial
    piece of it, or may.

    Each piece *is* the original ``nn.Parameter`` object, its ``.data`` now the view (as
    FSDP1's ``use_orig_params``), so an optimizer built before wrapping keeps stepping
    the same objects; an original this rank holds no piece of stays empty (0 elements),
    marked so that such an optimizer is accepted (it gets no gradient, so no step)."""

    def __init__(
        self,
        shard: nn.Parameter,
        pieces: list[tuple[str, int, torch.Size, int, int]],
        ranks: tuple[int, int],
        compute_dtype: torch.dtype,
        cut: bool,
        originals: list[nn.Parameter | None],
    ) -> None:
        """``pieces``: (name, slot index, the parameter's shape, piece numel, offset in the
        shard) per piece this rank holds; ``originals``: the original parameter of each
        slot (None where it is gone)."""
        self.shard = shard
        self.pieces: list[OrigParam] = []
        held = {slot for _, slot, _, _, _ in pieces}
        with torch.no_grad():
            for name, slot, shape, numel, at in pieces:
                whole = numel == shape.numel()
                view_shape = tuple(shape) if whole else (1,) * (len(shape) - 1) + (numel,)
                view = shard[at : at + numel].view(view_shape)
                param = _reuse(originals[slot], view)
                if param is None:
                    param = nn.Parameter(view, requires_grad=shard.requires_grad)
                mark_shard(param, ranks, compute_dtype)
                if cut:
                    param.__dict__[_CUT_ATTR] = shape
                self.pieces.append(
                    OrigParam(name, slot, at, numel, param, view_shape, view.data_ptr())
                )
        self._ptrs = [o.ptr for o in self.pieces]
        for slot, original in enumerate(originals):
            if slot not in held and original is not None:
                mark_shard(original, ranks, compute_dtype)  # empty: never a gradient
        # The shard-shaped grad their grads were last pointed into, and those views.
        self._linked_grad: weakref.ref | None = None
        self._linked_views: list[weakref.ref] | None = None

    def _viewing_shard(self, t: torch.Tensor, o: OrigParam, base: torch.Tensor) -> bool:
        """Is ``t`` still the view of ``base[o.at : o.at + o.numel]`` it was made as?"""
        return t.data_ptr() == base.data_ptr() + o.at * base.element_size() and (
            tuple(t.shape) == o.shape
        )

    def _still_linked(
        self,
        grad: torch.Tensor | None,
        view: torch.Tensor | None,
        o: OrigParam,
        linked: torch.Tensor,
    ) -> bool:
        """Is a piece's ``grad`` the view of ``linked`` that ``link`` gave it, unreplaced
        (``p.grad = t`` and ``p.grad.data = t`` both replace it)?"""
        return view is not None and grad is view and self._viewing_shard(grad, o, linked)

    def adopt_writes(self, before_write: Callable[[nn.Parameter], None]) -> None:
        """Pieces whose ``.data`` was replaced: their values into the shard, then view it
        again (see ``FlatParam.adopt_orig_writes``)."""
        if [o.param.data_ptr() for o in self.pieces] == self._ptrs:
            return  # the steady state: one pointer read per piece
        shard = self.shard.detach()
        moved = [o for o in self.pieces if o.param.data_ptr() != o.ptr]
        before_write(self.shard)
        with torch.no_grad():
            for o in moved:
                value = o.param.detach()
                if value.numel() != o.numel:
                    raise RuntimeError(
                        f"fsdp_lite: '{o.name}' (this rank's piece of {o.numel} elements) was "
                        f"given .data of shape {tuple(value.shape)}: a parameter's shape "
                        "cannot change under fsdp_lite. Write values in place, or inside "
                        "summon_full_params() for the full parameter"
                    )
                region = shard[o.at : o.at + o.numel]
                region.copy_(value.reshape(-1))
                o.param.data = region.view(o.shape)

    def __iter__(self) -> Iterator[OrigParam]:
        return iter(self.pieces)

    def params(self) -> list[nn.Parameter]:
        return [o.param for o in self.pieces]

    def grads(self) -> list[torch.Tensor]:
        """Each piece's gradient that is not None (what clipping scales and norms count)."""
        return [g for o in self.pieces if (g := o.param.grad) is not None]

    def grad_as_shard(self) -> torch.Tensor | None:
        """The gradients as one shard-shaped tensor (zeros where a piece has none), for
        reading; None where there are none."""
        if not self.grads():
            return None
        out = torch.zeros_like(self.shard.detach())
        for o in self.pieces:
            if o.param.grad is not None:
                out[o.at : o.at + o.numel].copy_(o.param.grad.reshape(-1))
        return out

    def fold(self) -> torch.Tensor | None:
        """Before an accumulation: the shard grad as the pieces' grads define it.

        Between backwards the pieces' grads are views of one shard-shaped tensor that only
        they hold (this keeps weak references), so ``zero_grad(set_to_none=True)`` frees it
        as it would a plain model's grads. If every one is still that view, it is
        accumulated into in place (as torch accumulates into ``p.grad``); if every one is
        None, a new one is made; otherwise a new one is filled from their grads (None:
        zero; an assigned tensor: its values), never writing into a tensor the user may
        still hold."""
        linked = _deref(self._linked_grad)
        current = [o.param.grad for o in self.pieces]
        if linked is not None and all(
            g is None if ref is None else self._still_linked(g, ref(), o, linked)
            for o, g, ref in zip(self.pieces, current, self._linked_views, strict=True)
        ):
            return linked
        if all(g is None for g in current):
            return None
        fresh = torch.zeros_like(self.shard.detach())
        with torch.no_grad():
            for o, g in zip(self.pieces, current, strict=True):
                if g is not None:
                    fresh[o.at : o.at + o.numel].copy_(g.reshape(-1))
        return fresh

    def link(self) -> None:
        """End of backward: point each trainable piece's grad at its region of the shard
        grad, which then only they hold. A piece whose ``requires_grad`` was turned off
        after wrapping gets none, so no optimizer steps it."""
        if self.shard.grad is None:
            return
        grad, self.shard.grad = self.shard.grad, None
        views = [
            grad[o.at : o.at + o.numel].view(o.shape) if o.param.requires_grad else None
            for o in self.pieces
        ]
        for o, view in zip(self.pieces, views, strict=True):
            o.param.grad = view
        self._linked_grad = weakref.ref(grad)
        self._linked_views = [None if v is None else weakref.ref(v) for v in views]


def _deref(ref: weakref.ref | None) -> Any:
    return None if ref is None else ref()


def _reuse(original: nn.Parameter | None, view: torch.Tensor) -> nn.Parameter | None:
    """``original`` made a view of ``view``'s storage (its identity kept), or None where it
    cannot be: gone, or not a plain real ``nn.Parameter``."""
    if type(original) is not nn.Parameter or original.is_meta:
        return None
    original.data = view
    return original
