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

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor

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
