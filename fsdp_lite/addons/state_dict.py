"""Full state dicts with the original module's keys (no wrapper prefixes).

[Note: one flat param at a time]
Every path here walks the units and their flat params in the same order on every
rank and moves one flat param at a time: a gather for ``state_dict``, a broadcast for
``load_state_dict(rank0_only=True)``. The whole model is never materialized on a rank
that does not keep it, so peak memory stays one flat param above the sharded footprint
(plus, on the rank that keeps it, the CPU copy it returns).
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdp_lite.core import collectives
from fsdp_lite.core.flat_param import FlatParam
from fsdp_lite.core.state import TrainingState, check_state
from fsdp_lite.core.tree import clean_named_modules, units_of

if TYPE_CHECKING:
    from fsdp_lite.core.unit import Unit

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])
Location = tuple[int, str]  # (id(module), attribute)


def _param_names(module: nn.Module) -> list[str]:
    order = module.__dict__.get("_fsdp_lite_param_order")
    if order is None:
        return [n for n, p in module._parameters.items() if p is not None]
    return order


def _persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set:
            yield name, buf


def check_idle(root: nn.Module, doing: str) -> list[Unit]:
    """Every unit of ``root``'s tree, after checking that each is IDLE and taking in orig
    params given new ``.data`` (``FlatParam.adopt_orig_writes``)."""
    units = units_of(root)
    for unit in units:
        check_state(unit.name, unit.state, TrainingState.IDLE, doing=doing)
    for unit in units:
        for flat in unit.flat_params:
            flat.adopt_orig_writes()
    return units


def flat_params(root: nn.Module) -> list[FlatParam]:
    """Every flat param of the tree, in the same order on every rank."""
    return [flat for unit in units_of(root) for flat in unit.flat_params]


def _first_unit(root: nn.Module) -> Unit:
    """The model's root unit, or (a plain module holding units) its first unit: its shard
    and replicate groups are the model's, its tag issues the model's broadcasts."""
    units = units_of(root)
    if not units:
        raise ValueError(f"{type(root).__name__} holds no fsdp_lite.FSDPModule")
    return units[0]


def _groups(root: nn.Module) -> tuple[collectives.ProcessGroup, collectives.ProcessGroup | None]:
    unit = _first_unit(root)
    return unit.process_group, unit.replicate_group


def is_rank0(root: nn.Module) -> bool:
    """Rank 0 of the model's ranks: of its shard group and, with hybrid sharding, of its
    replicate group too (global rank 0 for ``fsdp_lite.hybrid_groups``), and of the meshes
    of its DTensor parameters."""
    group, replicate = _groups(root)
    first_replica = replicate is None or collectives.rank(replicate) == 0
    return collectives.rank(group) == 0 and first_replica and _first_on_meshes(root)


def _first_on_meshes(root: nn.Module) -> bool:
    """At coordinate 0 of every DTensor parameter's mesh (TP peers hold other parts)."""
    meshes = {
        id(s.layout.mesh): s.layout.mesh for f in flat_params(root) for s in f.slots if s.layout
    }
    return all(not any(mesh.get_coordinate()) for mesh in meshes.values())


def broadcast_from_rank0(root: nn.Module, tensor: torch.Tensor) -> None:
    """In place, from ``is_rank0``'s rank to every rank of the model (collective): across
    the replicas first (between the shard groups' rank 0s), then within each shard group."""
    unit = _first_unit(root)
    group, replicate = unit.process_group, unit.replicate_group
    if replicate is not None and collectives.rank(group) == 0:
        collectives.broadcast(tensor, replicate, tag=unit.tag)
    collectives.broadcast(tensor, group, tag=unit.tag)


def broadcast_object_from_rank0(root: nn.Module, obj: Any) -> Any:
    group, replicate = _groups(root)
    if replicate is not None and collectives.rank(group) == 0:
        obj = collectives.broadcast_object(obj, replicate)
    return collectives.broadcast_object(obj, group)


def refuse_rank0_only_with_dtensors(root: nn.Module, what: str) -> None:
    """A load read from rank 0 only reaches the ranks of rank 0's shard group, not its TP
    peers: refused for a model with DTensor parameters, on every rank alike."""
    if any(s.layout is not None for f in flat_params(root) for s in f.slots):
        raise NotImplementedError(
            f"{what}(rank0_only=True) of a model with DTensor parameters (tensor, sequence "
            "or expert parallel): every rank of the TP mesh needs the values. Pass the same "
            "full dict on every rank (rank0_only=False), or use fsdp_lite.load_checkpoint"
        )


# -- where a rank's shard sits in the original parameters -------------------------


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple, tuple, int]]:
    """Elements ``[lo, hi)`` of a row-major tensor of ``shape`` as rectangular boxes
    ``(offsets, sizes, first flat index)``, each contiguous in memory.

    Worked example, shape (3, 4), elements [2, 11): ``((0, 2), (1, 2), 2)`` (row 0,
    columns 2-3), ``((1, 0), (1, 4), 4)`` (row 1) and ``((2, 0), (1, 3), 8)``.
    """
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,), lo)]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)

    def row(r: int, a: int, b: int) -> list[tuple[tuple, tuple, int]]:
        return [((r, *o), (1, *s), r * inner + f) for o, s, f in boxes(shape[1:], a, b)]

    if r0 == r1:
        return row(r0, c0, c1)
    out = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:]), r0 * inner))
    if c1:
        out += row(r1, 0, c1)
    return out


@torch.no_grad()
def write_shard(shard: torch.Tensor, flat: FlatParam, values: dict[int, torch.Tensor]) -> None:
    """Copy this rank's part of each slot's full value (``values[slot index]``, any
    shape with the slot's numel) into the shard-shaped ``shard``; other slots keep theirs."""
    if shard is flat.shard:
        flat.home.before_host_write(flat.shard)
    for i, lo, hi, at in flat.pieces():
        if i in values:
            shard[at : at + hi - lo].copy_(values[i].reshape(-1)[lo:hi])


@dataclass(frozen=True)
class StateKey:
    """One key of the unwrapped model's full state dict, where it lives now."""

    key: str
    module: nn.Module
    attr: str
    # A parameter still registered (left unflattened: ignored) or a persistent buffer;
    # None for a flattened parameter (its value is in a flat param's slot).
    tensor: torch.Tensor | None
    saved_dtype: torch.dtype | None  # a buffer's original dtype (mixed precision casts it)


def state_keys(root: nn.Module) -> Iterator[StateKey]:
    """Every key of the unwrapped model's full state dict, in its order: module by module,
    its parameters (flattened or not), then its persistent buffers."""
    for prefix, module in clean_named_modules(root):
        pre = f"{prefix}." if prefix else ""
        for name in _param_names(module):
            p = module._parameters.get(name)
            yield StateKey(pre + name, module, name, p, None if p is None else p.dtype)
        dtypes = module.__dict__.get("_fsdp_lite_buffer_dtypes", {})
        for name, buf in _persistent_buffers(module):
            yield StateKey(pre + name, module, name, buf, dtypes.get(name, buf.dtype))


def _by_location(root: nn.Module, value: Callable[[FlatParam, int], Any]) -> dict[Location, Any]:
    """(id(module), attr) -> ``value(flat, slot index)`` at every location of every slot."""
    out: dict[Location, Any] = {}
    for flat in flat_params(root):
        for i, slot in enumerate(flat.slots):
            for module, attr in slot.locations:
                out[(id(module), attr)] = value(flat, i)
    return out


def param_names(root: nn.Module) -> dict[int, str]:
    """id(slot) -> the parameter's name in the unwrapped module's ``named_parameters()``
    (a tied parameter appears once, under its first name)."""
    slot_at = _by_location(root, lambda flat, i: flat.slots[i])
    names: dict[int, str] = {}
    for e in state_keys(root):
        slot = slot_at.get((id(e.module), e.attr)) if e.tensor is None else None
        if slot is not None and id(slot) not in names:
            names[id(slot)] = e.key
    return names


def state_dict_layout(
    root: nn.Module,
) -> tuple[dict[str, tuple[FlatParam, int]], dict[str, tuple[torch.Tensor, torch.dtype]]]:
    """Where each key of the full state dict lives: ``key -> (flat param, slot index)`` for
    flattened parameters (tied ones under every name), and ``key -> (tensor, dtype to
    save it in)`` for buffers and any parameter left unflattened."""
    slot_at = _by_location(root, lambda flat, i: (flat, i))
    slots: dict[str, tuple[FlatParam, int]] = {}
    tensors: dict[str, tuple[torch.Tensor, torch.dtype]] = {}
    for e in state_keys(root):
        if e.tensor is not None:
            tensors[e.key] = (e.tensor, e.saved_dtype)
        elif (id(e.module), e.attr) in slot_at:
            slots[e.key] = slot_at[(id(e.module), e.attr)]
    return slots, tensors


def expected_shapes(root: nn.Module) -> dict[str, torch.Size]:
    """Every key of the full state dict and its shape, in the unwrapped module's order."""
    shapes = _by_location(root, lambda flat, i: flat.slots[i].full_shape)
    out: dict[str, torch.Size] = {}
    for e in state_keys(root):
        shape = e.tensor.shape if e.tensor is not None else shapes.get((id(e.module), e.attr))
        if shape is not None:
            out[e.key] = shape
    return out


def _gather_slots(flats: list[FlatParam], grads: bool, keep: bool) -> dict[Location, torch.Tensor]:
    """Location -> full fp32 CPU tensor of every slot, gathered one flat param at a time
    (collective). With ``keep=False`` the gathers still run but nothing is kept."""
    values: dict[Location, torch.Tensor] = {}
    for flat in flats:
        if grads and not flat.requires_grad:
            continue
        source = flat.shard
        if grads:
            grad = flat.grad_as_shard()
            source = grad if grad is not None else torch.zeros_like(source)
        full = flat.gather_fp32(source)  # (numel,): the only full copy on this rank
        for slot in flat.slots:
            # A DTensor's whole value is gathered over its mesh on every rank (collective)
            piece = slot.whole_value(full[slot.offset : slot.offset + slot.numel])
            if keep:
                tensor = piece.to("cpu", copy=True)
                for module, attr in slot.locations:
                    values[(id(module), attr)] = tensor
        del full
    return values


def full_state_dict(root: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Gather every unit's parameters in fp32 onto CPU (collective: call on every rank).

    With ``rank0_only`` other ranks return ``{}`` and hold at most one flat param's full
    copy at a time; rank 0 holds the returned CPU dict plus one flat param.
    """
    check_idle(root, "produce a state dict")
    keep = not rank0_only or is_rank0(root)
    values = _gather_slots(flat_params(root), grads=False, keep=keep)
    if not keep:
        return {}
    sd: dict[str, torch.Tensor] = {}
    for e in state_keys(root):
        if e.tensor is not None:  # a buffer in its original dtype, or a whole parameter
            sd[e.key] = e.tensor.detach().to("cpu", e.saved_dtype, copy=True)
        elif (id(e.module), e.attr) in values:
            sd[e.key] = values[(id(e.module), e.attr)]
    return sd


def full_grads(root: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients of every trainable parameter, unsharded, keyed like the state dict.

    Collective; for tests and debugging (it materializes every gradient on every rank).
    Parameters without a gradient this iteration read as zeros; parameters left unsharded
    (ignored ones, whole on every rank) read as their own ``.grad``.
    """
    check_idle(root, "gather gradients")
    values = _gather_slots(flat_params(root), grads=True, keep=True)
    out: dict[str, torch.Tensor] = {}
    for e in state_keys(root):
        p = e.tensor
        if p is None and (id(e.module), e.attr) in values:
            out[e.key] = values[(id(e.module), e.attr)]
        elif isinstance(p, nn.Parameter) and p.requires_grad:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            out[e.key] = grad.detach().to("cpu", torch.float32, copy=True)
    return out


def module_state_dict_hook(
    unit: Unit, module: nn.Module, destination: dict, prefix: str, local_metadata: Any
) -> None:
    """``state_dict()`` called on the wrapped module itself (``model.module.state_dict()``,
    which HF's ``save_pretrained`` calls): add the full fp32 values of the unit's own
    parameters, which its modules no longer hold, in the unwrapped model's key order, and
    buffers in their original dtype. Nested units add theirs through their wrappers'
    ``state_dict``. Collective, like ``FSDPModule.state_dict``: every rank must call it."""
    check_state(unit.name, unit.state, TrainingState.IDLE, doing="produce a state dict")
    values = _gather_slots(unit.flat_params, grads=False, keep=True)
    order = []
    for path, sub in clean_named_modules(module):
        pre = prefix + (f"{path}." if path else "")
        for name in _param_names(sub):
            if (id(sub), name) in values:
                destination[pre + name] = values[(id(sub), name)]
            order.append(pre + name)
        dtypes = sub.__dict__.get("_fsdp_lite_buffer_dtypes", {})
        for name, _ in _persistent_buffers(sub):
            if pre + name in destination and name in dtypes:
                destination[pre + name] = destination[pre + name].to(dtypes[name])
            order.append(pre + name)
    for key in order:  # the unwrapped model's order
        if key in destination:
            destination[key] = destination.pop(key)


# -- loading ------------------------------------------------------------------------


def validate_keys(
    expected: dict[str, torch.Size],
    shapes: dict[str, tuple[int, ...]],
    strict: bool,
    what: str,
    hint: str = "pass strict=False to load a subset",
) -> IncompatibleKeys:
    """Compare a checkpoint's keys and shapes with the model's; raise naming every problem."""
    missing = [k for k in expected if k not in shapes]
    unexpected = [k for k in shapes if k not in expected]
    misshapen = [
        f"{k}: checkpoint {tuple(shapes[k])}, model {tuple(shape)}"
        for k, shape in expected.items()
        if k in shapes and tuple(shapes[k]) != tuple(shape)
    ]
    problems = []
    if misshapen:
        problems.append("wrong shapes: " + "; ".join(misshapen))
    if strict and missing:
        problems.append(f"missing keys: {missing}")
    if strict and unexpected:
        problems.append(f"unexpected keys: {unexpected}")
    if problems:
        raise RuntimeError(
            f"{what}: the state dict does not match the model (nothing was loaded): "
            + " | ".join(problems)
            + f". Keys are the unwrapped module's (no 'module.' prefixes); {hint}"
        )
    return IncompatibleKeys(missing, unexpected)


@torch.no_grad()
def load_full_state_dict(
    root: nn.Module, sd: dict[str, Any], strict: bool = True, rank0_only: bool = False
) -> IncompatibleKeys:
    """Load a full state dict into the shards (collective when ``rank0_only``).

    Without ``rank0_only`` every rank passes the same dict and nothing is communicated.
    With it only rank 0's dict is read: the key list goes out first (so every rank raises
    the same error on a mismatch), then each flat param and buffer is broadcast in turn.
    """
    units = check_idle(root, "load a state dict")
    if rank0_only:
        refuse_rank0_only_with_dtensors(root, "load_state_dict")
    is_source = not rank0_only or is_rank0(root)
    shapes: Any = {}
    if is_source:
        if isinstance(sd, dict):
            shapes = {k: tuple(v.shape) for k, v in sd.items() if torch.is_tensor(v)}
        else:
            shapes = TypeError(f"load_state_dict needs a dict, got {type(sd).__name__}")
    if rank0_only:  # every rank raises the same error, none waits for rank 0
        shapes = broadcast_object_from_rank0(root, shapes)
    if isinstance(shapes, Exception):
        raise shapes
    result = validate_keys(expected_shapes(root), shapes, strict, "load_state_dict")
    keys = {id(m): (f"{p}." if p else "") for p, m in clean_named_modules(root)}
    for unit in units:
        unit.reshard()  # full params kept by reshard_after_forward=False would go stale
        for flat in unit.flat_params:
            found = {i: _find_key(shapes, keys, s.locations) for i, s in enumerate(flat.slots)}
            found = {i: k for i, k in found.items() if k is not None}
            if not found:
                continue
            values = {}
            if is_source:  # a DTensor parameter's local part of the whole value
                values = {i: flat.slots[i].local_value(sd[k]) for i, k in found.items()}
            if rank0_only:
                values = broadcast_slots(root, flat, values, list(found), flat.shard.dtype)
            write_shard(flat.shard, flat, values)
    for prefix, module in clean_named_modules(root):
        pre = f"{prefix}." if prefix else ""
        tensors = [(n, p) for n, p in module._parameters.items() if p is not None]
        for name, tensor in tensors + list(_persistent_buffers(module)):
            if pre + name in shapes:
                if is_source:
                    tensor.copy_(sd[pre + name])
                if rank0_only:
                    broadcast_from_rank0(root, tensor)
    return result


def broadcast_slots(
    root: nn.Module,
    flat: FlatParam,
    values: dict[int, torch.Tensor],
    present: list[int],
    dtype: torch.dtype,
) -> dict[int, torch.Tensor]:
    """Rank 0's values of the slots in ``present`` (``values`` is read on rank 0 only), as
    views of one broadcast flat tensor of ``flat``'s unpadded size (collective)."""
    full = torch.zeros(flat.numel, dtype=dtype, device=flat.shard.device)
    if is_rank0(root):
        for i in present:
            slot = flat.slots[i]
            full[slot.offset : slot.offset + slot.numel].copy_(values[i].reshape(-1))
    broadcast_from_rank0(root, full)
    return {i: full[flat.slots[i].offset :][: flat.slots[i].numel] for i in present}


def _find_key(shapes: dict[str, Any], keys: dict[int, str], locations) -> str | None:
    for module, attr in locations:
        key = keys.get(id(module), "?") + attr
        if key in shapes:
            return key
    return None
