"""What the optimizer sees of a flat param: its shard, or (optimizer_params 'pieces'
or 'whole') this rank's piece of each original parameter as an ``nn.Parameter`` view of
the shard, whose gradients are folded into the shard grad before an accumulation and
pointed back into it at the end of backward.

Every such parameter carries marks (``shard_ranks``, ``cut_from``) so that code which sees
only parameters -- the optimizer misuse check, the grad scaler -- needs no unit tree.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
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


def unaveraged(params: list[nn.Parameter], modules: Iterator[nn.Module]) -> list[int]:
    """Indices of the trainable ``params`` whose gradients nothing averages across ranks:
    not an fsdp_lite shard, nor a parameter of a ``DistributedDataParallel`` module among
    ``modules`` (which averages its own). The one rule of the forward and optimizer checks."""
    ddp = {
        id(p)
        for m in modules
        if isinstance(m, nn.parallel.DistributedDataParallel)
        for p in m.parameters()
    }
    return [
        i
        for i, p in enumerate(params)
        if p.requires_grad and shard_ranks(p) is None and id(p) not in ddp
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


class OrigParams:
    """The optimizer's parameters of one flat param (optimizer_params 'pieces' / 'whole'): one
    ``nn.Parameter`` per piece of an original parameter this rank holds, a view of the
    shard. A whole piece has the parameter's shape; a partial one is 1-D with leading 1s
    up to the parameter's ndim (so ``p.ndim`` sorts parameters into groups). With ``cut``
    (not whole params) every one is marked for ``cut_from``: some rank holds a partial
    piece of it, or may."""

    def __init__(
        self,
        shard: nn.Parameter,
        pieces: list[tuple[str, int, torch.Size, int, int]],
        ranks: tuple[int, int],
        compute_dtype: torch.dtype,
        cut: bool,
    ) -> None:
        """``pieces``: (name, slot index, the parameter's shape, piece numel, offset in the
        shard) per piece this rank holds."""
        self.shard = shard
        self.pieces: list[OrigParam] = []
        with torch.no_grad():
            for name, slot, shape, numel, at in pieces:
                whole = numel == shape.numel()
                view_shape = shape if whole else (1,) * (len(shape) - 1) + (numel,)
                view = shard[at : at + numel].view(view_shape)
                param = nn.Parameter(view, requires_grad=shard.requires_grad)
                mark_shard(param, ranks, compute_dtype)
                if cut:
                    param.__dict__[_CUT_ATTR] = shape
                self.pieces.append(OrigParam(name, slot, at, numel, param))
        # The shard-shaped grad their grads were last pointed into, and those views.
        self._linked_grad: weakref.ref | None = None
        self._linked_views: list[weakref.ref] | None = None

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
        views = [_deref(v) for v in self._linked_views or ()]
        current = [o.param.grad for o in self.pieces]
        frozen = [not o.param.requires_grad for o in self.pieces]  # linked to none
        if linked is not None and all(
            (f and g is None) or (v is not None and g is v)
            for g, v, f in zip(current, views, frozen, strict=True)
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
        views = [grad[o.at : o.at + o.numel].view(o.param.shape) for o in self.pieces]
        for o, view in zip(self.pieces, views, strict=True):
            o.param.grad = view if o.param.requires_grad else None
        self._linked_grad = weakref.ref(grad)
        self._linked_views = [weakref.ref(v) for v in views]


def _deref(ref: weakref.ref | None) -> Any:
    return None if ref is None else ref()
