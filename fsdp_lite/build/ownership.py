"""Whole-parameter sharding: which rank owns each original parameter.

With ``FSDPModule(..., optimizer_params="whole")`` a flat param is cut on parameter boundaries
instead of at ``numel / W``: each original parameter lives whole in one rank's shard, so
an optimizer that needs whole matrices (``torch.optim.Muon``) steps them with no
communication of its own. Owners are chosen largest parameter first, each onto the rank
that owns the fewest bytes so far (greedy LPT), over every parameter of the model, not
unit by unit: a unit may leave a rank nothing, and the largest parameter bounds the
imbalance (a rank owns at most the mean plus the largest parameter).

The bytes owned so far are counted per process group, for the life of the process: a
model wrapped unit by unit by hand (each block, then the root) is balanced over all its
units in the order they are wrapped, as one wrapped with ``auto_wrap_policy`` is.
"""

from __future__ import annotations

from torch import nn

from fsdp_lite.core import collectives
from fsdp_lite.core.policies import master_dtype


def master_nbytes(p: nn.Parameter) -> int:
    return p.numel() * master_dtype(p.dtype).itemsize


Location = tuple[int, str]  # (id(module), attribute): survives deferred init's new tensors


def plan_owners(
    params: list[tuple[nn.Module, str, nn.Parameter]], group: collectives.ProcessGroup
) -> dict[Location, int]:
    """The owning rank of each ``(module, attr, param)`` location (a tie's locations
    share one), balanced with everything wrapped on ``group`` before; the same answer on
    every rank of ``group`` (every rank wraps the same modules in the same order)."""
    size = collectives.world_size(group)
    # bytes of master parameters owned by each rank of the group so far
    state = collectives.group_state(group)
    if state.owned is None:
        state.owned = [0] * size
    owned = state.owned
    unique = list({id(p): p for _, _, p in params}.values())
    ranks = assign([master_nbytes(p) for p in unique], owned)
    rank_of = {id(p): r for p, r in zip(unique, ranks, strict=True)}
    return {(id(sub), attr): rank_of[id(p)] for sub, attr, p in params}


def assign(sizes: list[int], owned: list[int]) -> list[int]:
    """The owning rank of each item of ``sizes`` (bytes): largest first onto the rank that
    owns the fewest bytes (the lowest such rank on a tie); ``owned`` (bytes per rank so
    far) is updated in place."""
    ranks = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: order on ties
        rank = min(range(len(owned)), key=lambda r: (owned[r], r))
        ranks[i] = rank
        owned[rank] += sizes[i]
    return ranks


def forget_owned() -> None:
    """Forget every whole-params unit wrapped so far: the next model is balanced as if it
    were the first (for tests and benchmarks that wrap several models in one process;
    call it on every rank at the same point)."""
    collectives.forget_owned()
