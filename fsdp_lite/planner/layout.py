"""The memory planner's view of wrapping: which units ``FSDPModule(model, auto_wrap_policy=...)``
would build and what flat params each would hold, computed without wrapping anything.

It walks the model with wrapping's own walk (``wrap.picks``) and dtype rule
(``policies.compute_dtype``), and groups as ``unit_init.build_flat_params`` does: each
picked module owns
the parameters of its tree that no nested unit owns (ties used outside it are deferred to
the lowest enclosing unit), the model itself is the root and owns the rest, and each unit
groups its parameters by (dtype, requires_grad, compute dtype) into one flat param, padded
to a multiple of W. While the policy runs, parameters already owned by a picked unit are
hidden from ``_parameters`` (as wrapping removes them), so size-based policies count what
they would count when wrapping; every ``_parameters`` dict is restored, in order, after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from fsdp_lite.build import ownership
from fsdp_lite.build.wrap import Policy, picks, unowned_parameters
from fsdp_lite.core.policies import MixedPrecision, compute_dtype, master_dtype
from fsdp_lite.core.tree import unit_of

Location = tuple[nn.Module, str]


@dataclass
class SlotLayout:
    """One original parameter inside a flat param and every place it is registered."""

    locations: list[Location]
    shape: torch.Size


@dataclass
class FlatLayout:
    """One flat param of one unit, as wrapping at world size ``world_size`` would build it."""

    slots: list[SlotLayout]
    dtype: torch.dtype  # the parameters' own dtype
    compute_dtype: torch.dtype  # of the gathered full buffer
    requires_grad: bool
    world_size: int
    # whole_params: the elements the planned rank owns (see own_whole_params); None: even.
    rank_numel: int | None = None

    @property
    def numel(self) -> int:
        return sum(s.shape.numel() for s in self.slots)

    @property
    def shard_numel(self) -> int:
        if self.rank_numel is not None:
            return self.rank_numel
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        if self.rank_numel is not None:
            return self.numel  # cut on parameter boundaries: no padding
        return -(-self.numel // self.world_size) * self.world_size

    @property
    def master_dtype(self) -> torch.dtype:
        return master_dtype(self.dtype)

    @property
    def shard_bytes(self) -> int:
        """The master shard (also the size of its fp32 shard grad and of each optimizer state)."""
        return self.shard_numel * self.master_dtype.itemsize

    @property
    def full_bytes(self) -> int:
        """The gathered full buffer (also the size of its full gradient in backward)."""
        return self.padded_numel * self.compute_dtype.itemsize


@dataclass
class UnitLayout:
    name: str  # the module path ("" for the root)
    module: nn.Module
    is_root: bool
    flats: list[FlatLayout] = field(default_factory=list)
    has_nested: bool = False  # contains other units (frozen params then wait for the end)

    @property
    def full_bytes(self) -> int:
        return sum(f.full_bytes for f in self.flats)


def layout_units(
    model: nn.Module,
    world_size: int,
    policy: Policy | None,
    mixed_precision: MixedPrecision | None,
) -> list[UnitLayout]:
    """The units wrapping ``model`` would build, root first, then in module order."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for m in model.modules():
        if unit_of(m) is not None:
            raise ValueError(
                "estimate_memory takes the model before wrapping; "
                f"{type(m).__name__} is already an fsdp_lite.FSDPModule"
            )
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    picked: list[tuple[nn.Module, list]] = []
    with _hidden_parameters() as hide:
        if policy is not None:
            for pick in picks(model, policy):
                if not pick.again:  # wrapping's own walk; hidden before it goes on
                    members = _members(pick.module, pick.defer)
                    hide(members)
                    picked.append((pick.module, members))
        root_members = _members(model, set())
    units = [_unit(model, "", True, root_members, world_size, mixed_precision)]
    for child, members in picked:
        name = names.get(id(child), "?")
        units.append(_unit(child, name, False, members, world_size, mixed_precision))
    picked_ids = {id(c) for c, _ in picked}
    for unit in units:
        nested = [m for m in unit.module.modules() if m is not unit.module and id(m) in picked_ids]
        unit.has_nested = bool(nested)
    order = {id(m): i for i, m in enumerate(model.modules())}
    return [units[0]] + sorted(units[1:], key=lambda u: order.get(id(u.module), 0))


def own_whole_params(model: nn.Module, units: list[UnitLayout], world_size: int) -> float:
    """whole_params: give each parameter an owner as wrapping would (``ownership.py``, in
    the order the outermost unit plans them), plan for the rank that owns the most bytes
    (each flat param's ``rank_numel``), and return its owned bytes over the mean."""
    params = list({id(p): p for _, _, p in unowned_parameters(model)}.values())
    owned = [0] * world_size
    ranks = ownership.assign([ownership.master_nbytes(p) for p in params], owned)
    owner = {id(p): r for p, r in zip(params, ranks, strict=True)}
    rank = max(range(world_size), key=lambda r: (owned[r], -r))
    for unit in units:
        for flat in unit.flats:
            mine = [s for s in flat.slots if owner[id(_param_at(s.locations[0]))] == rank]
            flat.rank_numel = sum(s.shape.numel() for s in mine)
    mean = sum(owned) / world_size
    return owned[rank] / mean if mean else 1.0


def _param_at(location: Location) -> nn.Parameter:
    module, attr = location
    return module._parameters[attr]


def _members(module: nn.Module, defer: set[int]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    return [(s, a, p) for s, a, p in unowned_parameters(module) if id(p) not in defer]


@contextlib.contextmanager
def _hidden_parameters() -> Iterator:
    """``hide(members)`` removes parameters from their modules until the context exits."""
    saved: dict[int, tuple[nn.Module, list]] = {}

    def hide(members: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
        for sub, attr, _ in members:
            if id(sub) not in saved:
                saved[id(sub)] = (sub, list(sub._parameters.items()))
            sub._parameters.pop(attr, None)

    try:
        yield hide
    finally:
        for sub, items in saved.values():
            sub._parameters.clear()
            sub._parameters.update(items)


def _unit(
    module: nn.Module,
    name: str,
    is_root: bool,
    members: list[tuple[nn.Module, str, nn.Parameter]],
    world_size: int,
    mp: MixedPrecision | None,
) -> UnitLayout:
    """Group ``members`` as ``build_flat_params`` does: one slot per parameter (ties share
    it), one flat param per (dtype, requires_grad, compute dtype)."""
    groups: dict[tuple, list[SlotLayout]] = {}
    slot_of: dict[int, SlotLayout] = {}
    for sub, attr, p in members:
        if id(p) in slot_of:
            slot_of[id(p)].locations.append((sub, attr))
            continue
        if not p.is_floating_point():
            raise TypeError(
                f"parameter '{attr}' of {type(sub).__name__} has dtype {p.dtype}: fsdp_lite "
                "shards floating-point parameters only"
            )
        slot = slot_of[id(p)] = SlotLayout([(sub, attr)], p.shape)
        groups.setdefault((p.dtype, p.requires_grad, compute_dtype(mp, sub, p)), []).append(slot)
    flats = [
        FlatLayout(slots, dtype, compute, rg, world_size)
        for (dtype, rg, compute), slots in groups.items()
    ]
    return UnitLayout(name or f"<root {type(module).__name__}>", module, is_root, flats)
