"""Gradient norms over every shard of every rank (for clip_grad_norm_)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fsdp_lite.core import collectives
from fsdp_lite.core.accounting import Tag
from fsdp_lite.core.dtensors import Layout

if TYPE_CHECKING:
    from fsdp_lite.core.unit import Unit


# One gradient of a norm: (tensor, the group its flat param is sharded over, the layout of
# the DTensor parameter it is a piece of, or None).
Part = tuple[torch.Tensor, collectives.ProcessGroup, "Layout | None"]


def total_norm(
    parts: Sequence[Part],
    p: float,
    device: torch.device,
    group: collectives.ProcessGroup,
    whole: Sequence[torch.Tensor] = (),
    tag: Tag | None = None,
) -> torch.Tensor:
    """The ``p``-norm of every rank's shard ``parts`` and of ``whole`` (gradients equal on
    every rank, counted once: ignored parameters'), an fp32 scalar on ``device``.

    Each part counts once over the ranks that split it: summed over its shard group (one
    all-reduce per group, over ``group`` when there are none), then, for a piece of a
    DTensor parameter, over each dim of its mesh, weighted by ``1 / Layout.copies`` where
    the mesh replicates it. A NaN on any rank makes the result non-finite on every rank
    (``all_reduce``'s max keeps it). The all-reduces are issued under ``tag``."""
    inf = p == float("inf")
    op = "max" if inf else "sum"
    # (id(group), mesh) -> (group, layout, copies -> grads)
    buckets: dict[tuple[int, object], tuple[collectives.ProcessGroup, Layout | None, dict]] = {}
    for grad, grad_group, layout in parts:
        key = (id(grad_group), None if layout is None else layout.mesh)
        entry = buckets.setdefault(key, (grad_group, layout, {}))
        entry[2].setdefault(1 if layout is None else layout.copies, []).append(grad)
    if not buckets:
        buckets[(id(group), None)] = (group, None, {1: []})
    by_group: dict[int, list[tuple[int, object]]] = {}
    for key in buckets:
        by_group.setdefault(key[0], []).append(key)
    sums = []
    for keys in by_group.values():
        each = [_weighted(buckets[k][2], p, device) for k in keys]
        summed = torch.stack(each)
        collectives.all_reduce(summed, buckets[keys[0]][0], op=op, tag=tag)
        for i, k in enumerate(keys):
            part = summed[i : i + 1]
            layout = buckets[k][1]
            if layout is not None:  # over the mesh that splits it too
                part = part.clone()
                for dim_group in layout.dim_groups():
                    collectives.all_reduce(part, dim_group, op=op, tag=tag)
            sums.append(part)
    if whole:
        sums.append(_local(list(whole), p, device).view(1))
    total = torch.cat(sums)
    total = total.max() if inf else total.sum()
    return total if inf else total ** (1.0 / p)


def _weighted(by_copies: dict[int, list[torch.Tensor]], p: float, device: torch.device):
    """max |g| or sum |g|^p of the grads, each divided by its ``copies`` (p finite)."""
    if p == float("inf"):
        return torch.stack([_local(gs, p, device) for gs in by_copies.values()]).max()
    return torch.stack([_local(gs, p, device) / c for c, gs in by_copies.items()]).sum()


def _local(grads: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """max |g| (p = inf) or sum |g|^p over ``grads``, an fp32 scalar on ``device``: each
    device's part moved there once (CPU-offloaded grads: one copy, not one per grad)."""
    parts = [torch.zeros((), dtype=torch.float32, device=device)]
    for same in _by_device(grads).values():
        norms = torch.stack([n.float() for n in torch._foreach_norm(same, p)])
        parts.append((norms.max() if p == float("inf") else norms.pow(p).sum()).to(device))
    local = torch.stack(parts)
    return local.max() if p == float("inf") else local.sum()


def scale_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every gradient by the scalar ``coef``, copied once to each device and
    dtype the gradients have (CPU-offloaded grads: one copy of it, not one per grad)."""
    for on, same in _by_device(grads).items():
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in same:
            by_dtype.setdefault(g.dtype, []).append(g)
        here = coef.to(on)
        for dtype, gs in by_dtype.items():
            torch._foreach_mul_(gs, here.to(dtype))


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    grouped: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        grouped.setdefault(t.device, []).append(t)
    return grouped


def nonfinite_units(
    units: list[Unit], device: torch.device, group: collectives.ProcessGroup
) -> list[str]:
    """Names of the units with a non-finite grad on any rank (collective, issued under
    the first unit's tag)."""
    flags = torch.tensor(
        [
            any(not bool(torch.isfinite(g).all()) for f in u.flat_params for g in f.grads())
            for u in units
        ],
        dtype=torch.float32,
        device=device,
    )
    collectives.all_reduce(flags, group, op="max", tag=units[0].tag if units else None)
    return [u.name for u, bad in zip(units, flags.tolist(), strict=True) if bad]
