"""DTensor parameters inside a flat param: what tensor, sequence or expert parallelism
(``parallelize_module``) made of a parameter on the dims of the world mesh that are not
data parallel.

[Note: local tensors flattened, DTensors rebuilt]
A unit flattens a DTensor parameter by its *local* tensor (FSDP1 did the same), so the
shards, the gathers and the reduce-scatters over the data-parallel group see plain
tensors: ranks of one dp group share their other mesh coordinates, hence their local
shapes (uneven TP shards included). Each use of the full buffer rebuilds the parameter
as a DTensor with the placements it had before wrapping (``Layout.wrap``, through
``DTensor.from_local``), so TP plans, ``loss_parallel`` and the model's own DTensor code
run unchanged. ``from_local``'s backward redistributes the gradient to those placements
(a ``Partial`` one is summed over its dim, as FSDP2's post-backward does), so the full
gradient holds local gradients only, and the reduce-scatter averages them over dp.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_lite.core import collectives


@dataclass(frozen=True)
class Layout:
    """How a DTensor parameter lies on its (non-dp) mesh: enough to rebuild it from its
    local tensor."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size  # the global shape
    stride: tuple[int, ...]  # the global stride

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` (a view of the full buffer) as the DTensor the module sees;
        differentiable: the gradient comes back local, in these placements."""
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape,
            stride=self.stride,
        )  # fmt: skip

    def full_value(self, local: torch.Tensor) -> torch.Tensor:
        """The whole parameter from every mesh rank's ``local`` (collective over the mesh)."""
        with torch.no_grad():
            return self.wrap(local.detach()).full_tensor()

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor of the whole parameter ``full`` (no communication)."""
        with torch.no_grad():
            spread = distribute_tensor(full, self.mesh, self.placements, src_data_rank=None)
            return spread.to_local()

    @property
    def copies(self) -> int:
        """How many ranks of the mesh hold each element (the sizes of the replicated dims):
        a norm counts each element once by weighting this rank's part by ``1 / copies``."""
        return math.prod(
            self.mesh.size(i) for i, p in enumerate(self.placements) if isinstance(p, Replicate)
        )

    def dim_groups(self) -> list[collectives.ProcessGroup]:
        return [self.mesh.get_group(i) for i in range(self.mesh.ndim)]

    def coordinates(self) -> list[tuple[int, ...]]:
        """Every mesh coordinate along the dims that shard this parameter, with this rank's
        coordinate on the others: their parts (``part_at``) tile the global tensor once."""
        mine = self.mesh.get_coordinate()
        ranges = [
            range(self.mesh.size(k)) if _shards(p) else (mine[k],)
            for k, p in enumerate(self.placements)
        ]
        return list(itertools.product(*ranges))

    def my_part(self) -> Part:
        """Where this rank's local tensor lies in the global tensor."""
        return self.part_at(tuple(self.mesh.get_coordinate()))

    def part_at(self, coordinate: tuple[int, ...]) -> Part:
        """Where the local tensor of the rank at ``coordinate`` lies in the global tensor."""
        runs, shape = [], list(self.shape)
        for k, p in enumerate(self.placements):
            if _shards(p):
                d = p.dim % len(self.shape)
                if any(d == done for done, _ in runs):
                    raise NotImplementedError(
                        f"a DTensor sharded twice along one dim ({self.placements}) has no "
                        "box layout in a checkpoint"
                    )
                rs = _runs(p, self.shape, d, self.mesh.size(k), coordinate[k])
                runs.append((d, rs))
                shape[d] = sum(length for _, length, _ in rs)
        mine = tuple(coordinate) == tuple(self.mesh.get_coordinate())
        return Part(tuple(shape), tuple(runs), mine)


@dataclass(frozen=True)
class Part:
    """One mesh coordinate's local tensor of a DTensor parameter, placed in the global
    tensor: along each sharded dim, runs of consecutive local indices map to runs of
    consecutive global ones (one run for ``Shard``, ``split_factor`` for ``_StridedShard``)."""

    shape: tuple[int, ...]  # the local tensor's shape
    runs: tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]  # dim -> (local, len, global)
    mine: bool  # this rank's own local tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_global(self, offsets: tuple, sizes: tuple) -> list[tuple[tuple, tuple, int]]:
        """A box of the local tensor, contiguous in memory, as boxes of the global tensor
        ``(global offsets, sizes, local flat index)``, each contiguous in memory too."""
        out: list[tuple[tuple, tuple, int]] = []
        self._cut(list(offsets), list(sizes), out)
        return out

    def _cut(self, off: list[int], size: list[int], out: list) -> None:
        if 0 in size:
            return
        for d, runs in self.runs:
            inside = [r for r in runs if r[0] < off[d] + size[d] and off[d] < r[0] + r[1]]
            if len(inside) == 1:
                continue
            outer = next((k for k in range(d) if size[k] > 1), None)
            if outer is not None:  # rows first: a cut along d keeps each row contiguous
                for j in range(size[outer]):
                    self._cut(_at(off, outer, off[outer] + j), _at(size, outer, 1), out)
                return
            for start, length, _ in inside:
                a, b = max(off[d], start), min(off[d] + size[d], start + length)
                self._cut(_at(off, d, a), _at(size, d, b - a), out)
            return
        where = list(off)
        for d, runs in self.runs:
            start, _, global_start = next(r for r in runs if r[0] <= off[d] < r[0] + r[1])
            where[d] = global_start + off[d] - start
        index = sum(o * st for o, st in zip(off, _strides(self.shape), strict=True))
        out.append((tuple(where), tuple(size), index))


def _shards(placement: Placement) -> bool:
    """``Shard`` or ``_StridedShard`` (which is not a ``Shard`` subclass)."""
    return isinstance(placement, Shard | _StridedShard)


def _at(values: list[int], k: int, value: int) -> list[int]:
    return [value if i == k else v for i, v in enumerate(values)]


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return strides[::-1]


def _runs(
    placement: Placement, shape: torch.Size, dim: int, n: int, c: int
) -> tuple[tuple[int, int, int], ...]:
    """Runs ``(local start, length, global start)`` of the global indices along ``dim``
    that coordinate ``c`` of ``n`` holds, split as ``placement`` splits them (torch's own
    rule, uneven and strided shards included)."""
    size = shape[dim]
    index = torch.arange(size).view([size if k == dim else 1 for k in range(len(shape))])
    held = placement._split_tensor(index, n, with_padding=False)[0][c].reshape(-1).tolist()
    runs: list[list[int]] = []
    for local, g in enumerate(held):
        if runs and runs[-1][2] + runs[-1][1] == g:
            runs[-1][1] += 1
        else:
            runs.append([local, 1, g])
    return tuple(tuple(r) for r in runs)


def data_parallel_size(layout: Layout, dp_ranks: set[int]) -> int:
    """How many ranks of ``dp_ranks`` (a root's data-parallel ranks) the mesh dims of
    ``layout`` span: the dims whose groups meet them (expert parallel), not the others
    (tensor parallel, whose ranks share their data)."""
    me, size = collectives.global_rank(), 1
    for k, group in enumerate(layout.dim_groups()):
        if (set(collectives.global_ranks(group)) & dp_ranks) - {me}:
            size *= layout.mesh.size(k)
    return size


def layout_of(p: torch.Tensor) -> Layout | None:
    """The layout of a DTensor parameter; None for a plain tensor."""
    if not isinstance(p, DTensor):
        return None
    return Layout(p.device_mesh, tuple(p.placements), p.shape, tuple(p.stride()))


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``p``: its local tensor (DTensor) or ``p``, detached."""
    return p.to_local().detach() if isinstance(p, DTensor) else p.detach()


def check_layout(
    name: str,
    layout: Layout,
    groups: list[collectives.ProcessGroup],
) -> None:
    """Refuse a DTensor parameter the data-parallel ``groups`` (shard, replicate) cannot
    shard: one whose mesh shares ranks with them (its dims are not other dims of the same
    world mesh), or whose mesh this rank is not part of. Local facts, equal on every rank."""
    if layout.mesh.get_coordinate() is None:
        raise ValueError(
            f"fsdp_lite: parameter '{name}' is a DTensor on mesh {layout.mesh}, which this "
            "rank is not part of; build the TP/EP plan on a slice of the same world mesh "
            "whose dp slice you pass as FSDPModule(mesh=...)"
        )
    me = collectives.global_rank()
    dp = {r for g in groups for r in collectives.global_ranks(g)}
    for i, group in enumerate(layout.dim_groups()):
        shared = (set(collectives.global_ranks(group)) & dp) - {me}
        if shared:
            dims = layout.mesh.mesh_dim_names
            dim = dims[i] if dims else i
            raise ValueError(
                f"fsdp_lite: parameter '{name}' is a DTensor whose mesh dim {dim!r} shares "
                f"ranks {sorted(shared)} with the data-parallel group fsdp_lite shards over: "
                "tensor/sequence/expert parallel dims and the dp dims must be different dims "
                "of one world mesh. Pass the dp slice as FSDPModule(mesh=world['dp']) and "
                "parallelize on world['tp']"
            )
