"""Gradient norms over every shard of every rank (for clip_grad_norm_)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fsdp_lite.core import collectives
from fsdp_lite.core.dtensors import Layout

if TYPE_CHECKING:
    from fsdp_lite.core.unit import Unit


def total_norm(
    grads: list[torch.Tensor],
    p: float,
    device: torch.device,
    group: collectives.ProcessGroup,
    whole: Sequence[torch.Tensor] = (),
    spread: Sequence[tuple[torch.Tensor, Layout]] = (),
) -> torch.Tensor:
    """The ``p``-norm of ``grads`` over every rank's shards (an all-reduce over ``group``),
    of ``whole`` (gradients equal on every rank, counted once: ignored parameters') and of
    ``spread`` (pieces of DTensor parameters' local gradients: summed over their mesh too,
    each element once however many ranks of the mesh hold it): one multi-tensor norm per
    device the grads are on (fp32), combined in fp32 on ``device``. A NaN on any rank
    makes the result non-finite on every rank (``all_reduce``'s max keeps it)."""
    inf = p == float("inf")
    op = "max" if inf else "sum"
    by_mesh: dict[object, dict[int, list[torch.Tensor]]] = {}
    groups: dict[object, list[collectives.ProcessGroup]] = {}  # mesh -> its dims' groups
    for g, layout in spread:
        by_mesh.setdefault(layout.mesh, {}).setdefault(layout.copies, []).append(g)
        groups.setdefault(layout.mesh, layout.dim_groups())
    parts = [_local(grads, p, device)]
    for weights in by_mesh.values():  # each element counted once over the mesh
        each = [_local(gs, p, device) / (1 if inf else copies) for copies, gs in weights.items()]
        parts.append(torch.stack(each).max() if inf else torch.stack(each).sum())
    total = torch.stack(parts)
    collectives.all_reduce(total, group, op=op)
    if by_mesh:
        meshes = [total[:1]]
        for k, dim_groups in enumerate(groups.values(), start=1):
            part = total[k : k + 1].clone()
            for dim_group in dim_groups:
                collectives.all_reduce(part, dim_group, op=op)
            meshes.append(part)
        total = torch.cat(meshes)
    total = total.max() if inf else total.sum()
    if whole:
        total = torch.stack([total, _local(list(whole), p, device)])
        total = total.max() if inf else total.sum()
    return total if inf else total ** (1.0 / p)


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
    """Names of the units with a non-finite grad on any rank (collective)."""
    flags = torch.tensor(
        [
            any(not bool(torch.isfinite(g).all()) for f in u.flat_params for g in f.grads())
            for u in units
        ],
        dtype=torch.float32,
        device=device,
    )
    collectives.all_reduce(flags, group, op="max")
    return [u.name for u, bad in zip(units, flags.tolist(), strict=True) if bad]
