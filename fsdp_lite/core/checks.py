"""What is refused before anything changes: at wrap time (``check_wrappable``,
``check_dtensors``, a module's parameters one by one in ``check_param``) and at a root's
first forward, once per unit (``check_at_first_forward``: a TP plan applied after
wrapping, a smaller mesh than the root's without expert dims, hybrid replicas that
disagree, parameters no init wrote). Each check raises on every rank alike, from local
facts or one small collective, and says what to do."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_lite.core import collectives, dtensors, optim_view, optimizer_check
from fsdp_lite.core.policies import MixedPrecision, PrefetchPolicy
from fsdp_lite.core.state import TrainingState, check_state
from fsdp_lite.core.tree import SHARDED_FLAG, region_modules, unit_of, units_of
from fsdp_lite.core.unit import Unit


def check_at_first_forward(unit: Unit, root: Unit) -> None:
    """The checks of ``unit`` at the first forward of ``root`` (its root); sets how many
    ranks its gradients are averaged over (``mesh_divisor``)."""
    check_parallelized_before(unit)
    unit.average_grads_over(mesh_divisor(unit, root))
    check_replicas_agree(unit)
    check_initialized(unit)


def check_split_modules(unit: Unit, module: nn.Module) -> None:
    """Refuse a module whose parameters another unit sharded, met again outside that unit:
    a module registered at several places, only some of them inside a unit wrapped by hand.
    The other places would read that unit's full buffer while it is freed."""
    for sub in region_modules(module):
        ref = sub.__dict__.get("_fsdp_lite_sharded_by")
        owner = ref() if ref is not None else None
        if owner is None or owner is unit:
            continue
        paths = [n for n, m in module.named_modules(remove_duplicate=False) if m is sub]
        inside = next((n for n, m in module.named_modules() if unit_of(m) is owner), None)
        where = f"the unit '{inside}'" if inside else "another unit"
        raise ValueError(
            f"module {type(sub).__name__} is registered at several places ({', '.join(paths)}) "
            f"and {where}, wrapped by hand around only some of them, already sharded its "
            "parameters; a module used at several places must live in one unit. Wrap a "
            "common ancestor of every place instead, or let auto_wrap_policy place it"
        )


def check_param(name: str, p: nn.Parameter, owned: dict) -> None:
    """Refuse a parameter another unit already flattened (a misplaced tie), one left on the
    meta device, or one that is not floating point."""
    if id(p) in owned and owned[id(p)][1] is p:
        raise ValueError(
            f"parameter '{name}' is tied to a parameter already sharded by the nested unit "
            f"'{owned[id(p)][0]}'; a tied parameter must live in one unit. Do not wrap that "
            "submodule by hand: use auto_wrap_policy, which keeps tied parameters in the "
            "lowest unit that contains every use, or wrap a common ancestor instead"
        )
    earlier = optimizer_check.flattened_as(p)
    if earlier is not None:  # flattened by a unit outside this one
        raise ValueError(
            f"parameter '{name}' is tied to '{earlier}', which another unit (not nested "
            "in this one) already sharded; a tied parameter must live in one unit. Wrap a "
            "common ancestor of every use instead, or let auto_wrap_policy place the tie"
        )
    if p.is_meta:
        raise RuntimeError(
            f"fsdp_lite: parameter '{name}' is still on the meta device: its module's "
            "init (reset_parameters or param_init_fn) did not create it"
        )
    if not p.is_floating_point():
        raise TypeError(
            f"parameter '{name}' has dtype {p.dtype}: fsdp_lite shards floating-point "
            "parameters only; register it as a buffer instead"
        )


def check_replicas_agree(unit: Unit) -> None:
    """Hybrid sharding without ``sync_module_states``: the ranks of a replicate group hold
    the same slice, so they must start from the same values. At the first forward (a load
    after wrapping is a legitimate way to make them agree), compare a fingerprint of every
    shard across the replicate group: one small all-reduce per unit, once."""
    group = unit.replicate_group
    if unit.replicas_synced or group is None or collectives.world_size(group) == 1:
        return
    if not unit.flat_params:
        return
    shards = [flat.shard for flat in unit.flat_params]
    if bool(collectives.differ_across(shards, [group], unit.device, unit.tag).any()):
        raise ValueError(
            f"fsdp_lite: hybrid sharding: at the first forward the replicas of unit "
            f"'{unit.name}' hold different values for the same slice of its parameters (each "
            "replica initialized the model from its own random state, and nothing was loaded "
            "since), so they would never agree. Pass sync_module_states=True to FSDPModule "
            "(rank 0's values are broadcast at wrap time), seed every rank the same before "
            "building the model, or load a checkpoint before training"
        )


def check_initialized(unit: Unit) -> None:
    """A unit whose modules a ``param_init_fn`` initialized on the meta device (``no_init``
    included): at the first forward, refuse parameters still NaN, the storage no init and no
    load wrote (``deferred_init._EmptyIsNaN``). One small all-reduce per such unit, once."""
    if not unit.check_init:
        return
    device = collectives.comm_device(unit.process_group, unit.device)
    nan = torch.stack(
        [flat.shard.detach().isnan().any().to(device, torch.float32) for flat in unit.flat_params]
        or [torch.zeros((), device=device)]
    )
    for group in (unit.process_group, unit.replicate_group):
        if group is not None:
            collectives.all_reduce(nan, group, op="max", kind="init_check", tag=unit.tag)
    if not bool(nan.any()):
        unit.check_init = False
        return
    local = [
        flat.slots[i].name
        for flat in unit.flat_params
        for i, lo, hi, at in flat.pieces()
        if flat.shard.detach()[at : at + hi - lo].isnan().any()
    ]
    every = collectives.all_gather_object(local, unit.process_group)
    names = sorted({name for names in every for name in names})
    raise RuntimeError(
        f"fsdp_lite: unit '{unit.name}' was built on the meta device and, at its first "
        f"forward, parameters {names[:8]}{' ...' if len(names) > 8 else ''} hold storage "
        "that no init wrote (NaN): the param_init_fn left them uninitialized (to_empty "
        "alone, or no_init) and nothing was loaded since. Initialize them in param_init_fn (e.g. "
        "module.to_empty(device=..., recurse=False); module.reset_parameters()), or load a "
        "checkpoint (load_checkpoint, load_state_dict, load_pretrained) before the first "
        "forward"
    )


def mesh_divisor(unit: Unit, root: Unit) -> int:
    """How many ranks' gradients ``unit``'s reduction averages: its own groups' ranks, or,
    for a unit wrapped over a smaller mesh than its root's (experts sharded over dp / ep,
    FSDP2's ``dp_shard_mod_ep``), the root's data-parallel ranks, which the unit's groups
    and its DTensors' expert-parallel dims span together (an expert's gradient already
    sums the tokens of every ep rank). Anything else would train replicas that never
    agree: refused, on every rank alike."""
    want, own = _dp_size(root), _dp_size(unit)
    if unit is root or own == want:
        return own
    dp_ranks = set(collectives.global_ranks(root.process_group))
    if root.replicate_group is not None:
        dp_ranks |= set(collectives.global_ranks(root.replicate_group))
    for flat in unit.flat_params:
        for slot in flat.slots:
            spans = 1 if slot.layout is None else dtensors.data_parallel_size(slot.layout, dp_ranks)
            if own * spans != want:
                raise ValueError(
                    f"fsdp_lite: unit '{unit.name}' shards over {own} ranks, its root over "
                    f"{want}, and its parameter '{slot.name}' spans {spans} more through "
                    "expert-parallel mesh dims: the other ranks would hold replicas of it that "
                    "no reduction averages. Give the unit the root's mesh, a (replicate, "
                    "shard) mesh, or make the parameter a DTensor on the ep dim that takes "
                    "the rest (experts: mesh=world['dp_shard_mod_ep'], weights Shard(0) on "
                    "world['ep'])"
                )
    return want


def _dp_size(unit: Unit) -> int:
    replicas = unit.replicate_group
    return collectives.world_size(unit.process_group) * (
        collectives.world_size(replicas) if replicas is not None else 1
    )


def check_parallelized_before(unit: Unit) -> None:
    """At the first forward: refuse a tensor-parallel plan applied after wrapping. Its
    ``parallelize_module`` found no parameters at the unit's modules (they hold placeholders
    between steps) and only hooked their inputs and outputs, so the module would compute
    plain full weights with sharded activations. Local facts, equal on every rank."""
    for flat in unit.flat_params:
        for slot in flat.slots:
            if slot.layout is not None:
                continue
            for module, _ in slot.locations:
                hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
                if any(_from_dtensor_api(h) for h in hooks):
                    raise ValueError(
                        f"fsdp_lite: module {type(module).__name__} of unit '{unit.name}' "
                        f"carries tensor-parallel hooks but its parameter '{slot.name}' is "
                        "a plain tensor: parallelize_module (or distribute_module) ran after "
                        "FSDPModule wrapped it, when its parameters were already flattened. "
                        "Apply the TP plan first, then wrap: parallelize_module(model, "
                        "world['tp'], plan); FSDPModule(model, mesh=world['dp'])"
                    )


def _from_dtensor_api(hook: object) -> bool:
    module = getattr(getattr(hook, "func", hook), "__module__", None) or ""
    return module.startswith("torch.distributed.tensor")


def check_wrappable(
    module: nn.Module,
    mixed_precision: MixedPrecision | None,
    prefetch: PrefetchPolicy | None,
    offload: object,
    *,
    ignored: frozenset[int] = frozenset(),
) -> None:
    """Reject bad arguments before anything is changed. Parameters left unsharded
    (``ignored``: their ids, before they are marked; ``ignored.py``) may sit elsewhere."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"FSDPModule wraps an nn.Module, got {type(module).__name__}")
    if module.__dict__.get(SHARDED_FLAG):  # a unit's module, or a wrapper an outer unit wraps
        raise ValueError(
            f"{type(module).__name__} is already wrapped by fsdp_lite.FSDPModule: "
            "wrap each module once (nest units by wrapping children first, then the parent)"
        )
    for unit in units_of(module):  # a wrapped model wrapped again: see root.release_nested
        check_state(
            unit.name,
            unit.state,
            TrainingState.IDLE,
            doing="be wrapped again by an outer FSDPModule (wrap between iterations, after "
            "backward finished; after an exception in backward call reset_training_state() first)",
        )
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision must be fsdp_lite.MixedPrecision or None, got {mixed_precision!r}"
        )
    if prefetch is not None and not isinstance(prefetch, PrefetchPolicy):
        raise TypeError(f"prefetch must be fsdp_lite.PrefetchPolicy or None, got {prefetch!r}")
    if offload is not None and not callable(getattr(offload, "make_home", None)):
        raise TypeError(
            f"offload must be fsdp_lite.CPUOffload, SSDOffload or None, got {offload!r}"
        )
    devices = {
        str(p.device)
        for p in module.parameters()
        if not p.is_meta and id(p) not in ignored and optim_view.replicated_ranks(p) is None
    }
    if len(devices) > 1:
        raise ValueError(
            f"{type(module).__name__}'s parameters sit on different devices ({sorted(devices)}): "
            "move the module to one device (e.g. module.to('cpu')) before wrapping; "
            "FSDPModule then moves it to its compute device"
        )


def check_dtensors(
    module: nn.Module, ignored: frozenset[int], groups: list[collectives.ProcessGroup | None]
) -> None:
    """DTensor parameters (tensor, sequence or expert parallel) must lie on mesh dims apart
    from the data-parallel ``groups``, and be sharded (not left whole by ``ignored_params``
    or ``ignored_modules``, whose plain all-reduce would not see their placements): refused
    otherwise, before anything changes."""
    dp = [g for g in groups if g is not None]
    for name, p in module.named_parameters():
        layout = dtensors.layout_of(p)
        if layout is not None and id(p) in ignored:
            raise NotImplementedError(
                f"fsdp_lite: parameter '{name}' is a DTensor ({layout.placements}) left "
                "unsharded by ignored_params / ignored_modules: fsdp_lite averages such "
                "gradients as plain tensors. Let fsdp_lite shard it, or keep it out of the "
                "TP plan"
            )
        if layout is not None and p.is_meta:
            raise NotImplementedError(
                f"fsdp_lite: parameter '{name}' is a DTensor on the meta device: fsdp_lite's "
                "deferred init does not materialize DTensors yet. After parallelize_module, "
                "call model.to_empty(device=...) and initialize the weights (each rank holds "
                "its TP shard only), then wrap; or load a checkpoint after wrapping a "
                "materialized model"
            )
        if layout is not None:
            dtensors.check_layout(name, layout, dp)
