"""Wrap-time work of a unit: pick its parameters, flatten them, prepare its buffers (what
is refused on the way: ``checks.py``)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdp_lite.build import deferred_init, ownership
from fsdp_lite.build.wrap import unowned_parameters
from fsdp_lite.core import collectives, dtensors, optimizer_check
from fsdp_lite.core.checks import check_param, check_split_modules
from fsdp_lite.core.flat_param import FlatParam, ParamSlot
from fsdp_lite.core.nested import cast_floats
from fsdp_lite.core.policies import MixedPrecision, compute_dtype
from fsdp_lite.core.tree import (
    clean_named_modules,
    region_modules,
    unit_of,
)
from fsdp_lite.core.unit import Unit


def _flattened_by_nested(module: nn.Module) -> dict[int, tuple[str, nn.Parameter]]:
    """id(original param) -> (unit name, param) for parameters nested units already own."""
    owned: dict[int, tuple[str, nn.Parameter]] = {}
    for name, sub in module.named_modules():
        unit = unit_of(sub)
        if unit is not None:
            for flat in unit.flat_params:
                for ref in flat.original_refs:
                    p = ref()
                    if p is not None:
                        owned[id(p)] = (name or type(unit.module).__name__, p)
    return owned


def _make_flat(
    unit: Unit,
    members: list,
    compute_dtype: torch.dtype,
    sync: bool,
    owners: dict[ownership.Location, int] | None,
) -> FlatParam:
    """One FlatParam from (slot, original) pairs; the originals leave their modules. With
    ``owners`` (whole params: (id(module), attr) -> rank) the slots are laid out in owner
    order."""
    ranks = None
    if owners is not None:

        def where(slot: ParamSlot) -> ownership.Location:
            return id(slot.locations[0][0]), slot.locations[0][1]

        missing = [(*s.locations[0], p) for s, p in members if where(s) not in owners]
        owners = {**owners, **ownership.plan_owners(missing, unit.process_group)}
        members = sorted(members, key=lambda m: owners[where(m[0])])  # stable
        ranks = [owners[where(s)] for s, _ in members]
    offset = 0
    for slot, _ in members:
        slot.offset = offset
        offset += slot.numel
    flat = FlatParam(
        [s for s, _ in members],
        [p for _, p in members],
        group=unit.process_group,
        device=unit.device,
        compute_dtype=compute_dtype,
        home=unit.home,
        replicate_group=unit.replicate_group,
        sync=sync,
        owners=ranks,
        fp32_masters=unit.fp32_masters,
        tag=unit.tag,
        unit_key=id(unit),
    )
    for slot in flat.slots:
        for sub, attr in slot.locations:
            delattr(sub, attr)
            sub.__dict__["_fsdp_lite_sharded_by"] = weakref.ref(unit)
    optimizer_check.install_check()
    for slot, p in members:
        optimizer_check.empty_flattened(p, slot.name)
    flat.use_placeholders()
    return flat


def build_flat_params(
    unit: Unit,
    module: nn.Module,
    defer: frozenset[int],
    sync: bool,
    init_plan: deferred_init.InitPlan | None,
    owners: dict[ownership.Location, int] | None = None,
) -> list[FlatParam]:
    """Flatten the parameters of ``module`` that no nested unit owns, one FlatParam per
    (dtype, requires_grad, compute dtype), and replace them by views of the full buffer.
    ``owners``: whole-param sharding (see ``ownership.py``)."""
    check_split_modules(unit, module)
    owned = _flattened_by_nested(module)
    names = {id(m): n for n, m in clean_named_modules(module)}
    if init_plan is not None:  # deferred init: this unit's modules only, now
        # sync_module_states: every rank gets rank 0's values, whatever its own init wrote
        unit.check_init = init_plan.init_fn is not None and not sync
        for sub in region_modules(module):
            deferred_init.materialize(sub, names.get(id(sub), "?"), init_plan)
    groups: dict[tuple, list[tuple[ParamSlot, nn.Parameter]]] = {}
    slot_of: dict[int, ParamSlot] = {}
    key_of: dict[int, tuple] = {}  # id(param) -> its flat param's group key
    for sub, attr, p in unowned_parameters(module):
        name = f"{names.get(id(sub), '?')}.{attr}".lstrip(".")
        sub.__dict__.setdefault("_fsdp_lite_param_order", list(sub._parameters.keys()))
        if id(p) in defer:
            continue
        check_param(name, p, owned)
        key = (p.dtype, p.requires_grad, compute_dtype(unit.mixed_precision, sub, p))
        if id(p) in slot_of:  # a tie inside this unit: one slot, several locations
            if key_of[id(p)] != key:
                raise ValueError(
                    f"parameter '{name}' is tied to '{slot_of[id(p)].name}', but one use is in a "
                    "module that computes in fp32 under mixed precision (fp32_module_types) "
                    "and the other is not: a parameter has one compute dtype. Untie them or "
                    "adjust MixedPrecision.fp32_module_types"
                )
            slot_of[id(p)].locations.append((sub, attr))
            continue
        local = dtensors.local_tensor(p)  # a DTensor's (dtensors.py), else p
        slot = ParamSlot([(sub, attr)], name, local.shape, local.numel(), 0, dtensors.layout_of(p))
        slot_of[id(p)] = slot
        groups.setdefault(key, []).append((slot, p))
        key_of[id(p)] = key

    return [
        _make_flat(unit, members, compute_dtype, sync, owners)
        for (_, _, compute_dtype), members in groups.items()
    ]


def prepare_buffers(unit: Unit, module: nn.Module, sync: bool) -> None:
    """Move this unit's buffers to its device, optionally sync them from rank 0, and cast
    them to ``buffer_dtype`` (fp32 modules keep theirs); remember original dtypes."""
    mp = unit.mixed_precision
    for sub in region_modules(module):
        original = sub.__dict__.setdefault("_fsdp_lite_buffer_dtypes", {})
        for name, buf in sub._buffers.items():
            if buf is None:
                continue
            original.setdefault(name, buf.dtype)
            buf = buf.to(unit.device)
            if sync:
                groups = [unit.replicate_group, unit.process_group]
                collectives.broadcast_from_first(buf, groups, unit.tag)
            keep = mp is None or mp.buffer_dtype is None or isinstance(sub, mp.fp32_module_types)
            if buf.is_floating_point() and not keep:
                buf = buf.to(mp.buffer_dtype)
            sub._buffers[name] = buf


def install_fp32_modules(
    modules: Iterable[nn.Module], mp: MixedPrecision | None
) -> list[RemovableHandle]:
    """Make those of ``modules`` of ``mp.fp32_module_types`` take fp32 inputs and return
    ``param_dtype``; the hooks' handles (the planner removes them after its trace)."""
    if mp is None or mp.param_dtype == torch.float32:
        return []
    handles = []
    for sub in modules:
        if isinstance(sub, mp.fp32_module_types):
            handles.append(sub.register_forward_pre_hook(
                lambda m, args, kwargs: cast_floats((args, kwargs), torch.float32),
                with_kwargs=True,
            ))  # fmt: skip
            handles.append(sub.register_forward_hook(
                lambda m, args, out, dtype=mp.param_dtype: cast_floats(out, dtype)
            ))  # fmt: skip
    return handles
