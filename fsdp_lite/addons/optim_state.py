"""Optimizer state keyed by original parameter names, with original shapes.

An optimizer over an ``FSDPModule`` steps shards or pieces of them, so its state
(AdamW's ``exp_avg``, Muon's ``momentum_buffer``) is shaped like them. Here it is
translated to and from the unwrapped model's view: ``{"state": {name: {"step": t,
"exp_avg": Tensor[shape], ...}}, "param_groups": [{"lr": ..., "params": [name, ...]},
...]}`` -- ``Optimizer.state_dict()`` of the plain model with parameter names in place of
indices, which depends neither on the world size nor on the layout.

[Note: what an optimizer parameter covers]
By default an optimizer parameter is a flat param's shard: a run of every original
parameter of the flat param, all sharing one param group (a Linear's weight and bias
land together). With ``optimizer_params`` "pieces" or "whole" it is one original
parameter's piece on this rank (``FlatParam.orig_params``), so groups are per
parameter. Either way it is the run ``[at, at + numel)`` of the shard (an ``Entry``).
Ranks may hold different parameters -- with whole params each rank owns its own, and
an optimizer may hold nothing of a unit on some rank -- so every collective here walks
the model's flat params (the same on every rank), after one exchange of objects that
tells every rank which names, keys and groups exist (``exchange``).

[Note: which state is sharded]
A state tensor of its parameter's shape (the shard's, or the piece's) is sharded: it is
gathered and cut into original-shape tensors per parameter. Anything else (``step``,
0-dim tensors, Python numbers) is per optimizer parameter and copied to each original
parameter it covers. Loading reverses this (``entry_state_keys``): a key whose value is
a tensor of the parameter's shape for every parameter an entry covers is sharded. A
saved group records its hyperparameters and the names of its parameters; loading
requires the target optimizer's groups to hold exactly those names over all ranks (any
world size, either layout) and raises naming the difference otherwise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_lite.addons.state_dict import (
    broadcast_object_from_rank0,
    broadcast_slots,
    check_idle,
    flat_params,
    is_rank0,
    param_names,
    refuse_rank0_only_with_dtensors,
)
from fsdp_lite.core import collectives
from fsdp_lite.core.flat_param import FlatParam, ParamSlot

OptimStateDict = dict[str, Any]


@dataclass
class Entry:
    """One optimizer parameter (a shard or a piece of one) and what it covers."""

    param: torch.Tensor
    flat: FlatParam
    at: int  # where ``param`` starts in the shard
    slots: list[int]  # the flat param's slots it covers (a piece: one; a shard: all)
    names: list[str]  # their original names
    group: int  # index into optimizer.param_groups
    state: dict[str, Any]  # this rank's optimizer state of ``param``


def optimizer_entries(root: nn.Module, optimizer: torch.optim.Optimizer) -> list[Entry]:
    """The optimizer's parameters in its own order, each matched to what it covers."""
    names = param_names(root)
    where: dict[int, tuple[FlatParam, int, list[int]]] = {}
    for flat in flat_params(root):
        where[id(flat.shard)] = (flat, 0, list(range(len(flat.slots))))
        for o in flat.orig_params or ():
            where[id(o.param)] = (flat, o.at, [o.slot])
    entries = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            found = where.get(id(p))
            if found is None:
                raise ValueError(
                    f"optimizer param group {gi} holds a parameter of shape {tuple(p.shape)} "
                    "that is not a parameter of this model: build the optimizer from "
                    "model.parameters() after wrapping"
                )
            flat, at, slots = found
            slot_names = [names[id(flat.slots[i])] for i in slots]
            entries.append(Entry(p, flat, at, slots, slot_names, gi, optimizer.state.get(p, {})))
    return entries


def is_sharded(key: str, value: Any, e: Entry) -> bool:
    """A state value shaped like its parameter (``step`` never is: it counts steps)."""
    return torch.is_tensor(value) and key != "step" and value.shape == e.param.shape


@dataclass
class Exchanged:
    """What every rank learns of one optimizer from every rank (see Note)."""

    kinds: dict[str, dict[str, tuple]]  # name -> key -> ("sharded", dtype) | ("value", v)
    groups: list[dict]  # each group's hyperparameters and the names of its parameters


def exchange(root: nn.Module, optimizer: torch.optim.Optimizer, entries: list[Entry]) -> Exchanged:
    """Collective (one object all-gather): every rank's state keys and groups, merged; the
    same answer on every rank. Raises where ranks disagree about a parameter they both
    hold a piece of (different keys: different optimizers, or a rank that never stepped)."""
    mine: dict[str, dict[str, tuple]] = {}
    for e in entries:
        for name in e.names:
            kinds = mine.setdefault(name, {})
            for key, value in e.state.items():
                if is_sharded(key, value, e):
                    kinds[key] = ("sharded", value.dtype)
                elif torch.is_tensor(value):
                    kinds[key] = ("value", value.detach().to("cpu", copy=True))
                else:
                    kinds[key] = ("value", value)
    records = group_records(optimizer, entries)
    everyone = collectives.all_gather_object((mine, records), root.process_group)
    if len({len(r) for _, r in everyone}) > 1:
        raise RuntimeError(
            "optimizer param groups differ between ranks (counts "
            f"{[len(r) for _, r in everyone]}): build the same groups on every rank"
        )
    kinds: dict[str, dict[str, tuple]] = {}
    for r, (theirs, _) in enumerate(everyone):
        for name, their_kinds in theirs.items():
            if name in kinds and set(kinds[name]) != set(their_kinds):
                raise RuntimeError(
                    f"optimizer state of '{name}' differs between ranks holding it (keys "
                    f"{sorted(kinds[name])} and, on rank {r}, {sorted(their_kinds)}): every "
                    "rank must step the same optimizer over the same parameters"
                )
            kinds.setdefault(name, dict(their_kinds))
    names = param_names(root)
    _check_holders(root, names, kinds, [set(theirs) for theirs, _ in everyone])
    order = list(names.values())
    groups = []
    for gi, record in enumerate(everyone[0][1]):
        held = {n for _, records in everyone for n in records[gi]["params"]}
        groups.append({**record, "params": [n for n in order if n in held]})
    return Exchanged(kinds, groups)


def _check_holders(
    root: nn.Module, names: dict[int, str], kinds: dict, reported: list[set[str]]
) -> None:
    """Every rank whose shard holds part of a parameter with sharded state must hold it in
    this optimizer too: else its part would be missing (or its boxes unreadable)."""
    for flat in flat_params(root):
        for slot in flat.slots:
            name = names[id(slot)]
            if not any(k[0] == "sharded" for k in kinds.get(name, {}).values()):
                continue
            for q in range(len(reported)):
                start, end = flat.rank_range(q)
                holds = max(start, slot.offset) < min(end, slot.offset + slot.numel)
                if holds and name not in reported[q]:
                    raise RuntimeError(
                        f"rank {q} holds part of '{name}' but its optimizer does not step it, "
                        "while other ranks' do: build the same optimizers (the same rule for "
                        "param groups) on every rank"
                    )


def group_records(optimizer: torch.optim.Optimizer, entries: list[Entry]) -> list[dict]:
    """Each param group's hyperparameters, with the names of its parameters as ``params``
    (this rank's)."""
    records = []
    for gi, group in enumerate(optimizer.param_groups):
        names = [n for e in entries if e.group == gi for n in e.names]
        records.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return records


def local_state(flat: FlatParam, key: str, entries: list[Entry]) -> list[tuple[int, torch.Tensor]]:
    """This rank's state ``key`` over ``flat``'s shard: ``(at, 1-D view)`` per entry."""
    return [
        (e.at, e.state[key].detach().reshape(-1))
        for e in entries
        if e.flat is flat and key in e.state
    ]


def _shard_state(
    flat: FlatParam, segments: list[tuple[int, torch.Tensor]], dtype: torch.dtype
) -> torch.Tensor:
    """The segments as one shard-shaped tensor: the state itself where one covers the
    shard (an optimizer over flat shards), else a copy."""
    if len(segments) == 1 and segments[0][0] == 0 and segments[0][1].numel() == flat.shard_numel:
        return segments[0][1].to(dtype)
    local = torch.zeros(flat.shard_numel, dtype=dtype, device=flat.shard.device)
    for at, tensor in segments:
        local[at : at + tensor.numel()].copy_(tensor)
    return local


def shard_view(segments: list[tuple[int, torch.Tensor]], start: int, numel: int) -> torch.Tensor:
    """Elements ``[start, start + numel)`` of the shard from the entry that holds them."""
    for at, tensor in segments:
        if at <= start and start + numel <= at + tensor.numel():
            return tensor[start - at : start - at + numel]
    raise RuntimeError(
        f"fsdp_lite: no optimizer state on this rank for shard elements [{start}, "
        f"{start + numel}): the optimizer does not hold that parameter here"
    )


def sharded_keys(flat: FlatParam, names: dict[int, str], kinds: dict) -> dict[str, torch.dtype]:
    """The sharded state keys of any parameter of ``flat``, and their dtype."""
    keys: dict[str, torch.dtype] = {}
    for slot in flat.slots:
        for key, kind in kinds.get(names[id(slot)], {}).items():
            if kind[0] == "sharded":
                keys.setdefault(key, kind[1])
    return dict(sorted(keys.items()))


# -- full (consolidated) optimizer state dict ---------------------------------------


def full_optim_state_dict(
    root: nn.Module, optimizer: torch.optim.Optimizer, rank0_only: bool = True
) -> OptimStateDict:
    """The optimizer's state keyed by parameter names, full shapes, on CPU (collective).

    Gathers one flat param's state tensor at a time. With ``rank0_only`` (the default)
    only rank 0 keeps and returns the dict; other ranks return ``{}``.
    """
    check_idle(root, "produce an optimizer state dict")
    entries = optimizer_entries(root, optimizer)
    ex = exchange(root, optimizer, entries)
    keep = not rank0_only or is_rank0(root)
    names = param_names(root)
    state: dict[str, dict[str, Any]] = {}
    for flat in flat_params(root):
        for key, dtype in sharded_keys(flat, names, ex.kinds).items():
            local = _shard_state(flat, local_state(flat, key, entries), dtype)
            full = torch.empty(flat.padded_numel, dtype=dtype, device=local.device)
            collectives.all_gather_flat(
                full, local, flat.group, tag=flat.tag, sizes=flat.rank_sizes
            )
            for slot in flat.slots:
                kind = ex.kinds.get(names[id(slot)], {}).get(key)
                if kind is not None and kind[0] == "sharded":
                    # A DTensor's whole value is gathered over its mesh on every rank
                    piece = slot.whole_value(full[slot.offset : slot.offset + slot.numel])
                    if keep:
                        state.setdefault(names[id(slot)], {})[key] = piece.to("cpu", copy=True)
            del full
    if not keep:
        return {}
    for name, kinds in ex.kinds.items():
        for key, kind in kinds.items():
            if kind[0] == "value":
                state.setdefault(name, {})[key] = copy.deepcopy(kind[1])
    order = list(names.values())
    state = {n: dict(sorted(state[n].items())) for n in order if n in state}
    return {"state": state, "param_groups": ex.groups}


@torch.no_grad()
def load_full_optim_state_dict(
    root: nn.Module,
    optimizer: torch.optim.Optimizer,
    osd: OptimStateDict,
    rank0_only: bool = False,
) -> None:
    """Load a full, name-keyed optimizer state dict into the sharded ``optimizer``.

    Works at any world size and into either layout. Without ``rank0_only`` every rank
    passes the same dict; with it only rank 0's dict is read and each state tensor is
    broadcast one flat param at a time. One object all-gather checks the param groups
    over all ranks. Load the model's parameters separately.
    """
    check_idle(root, "load an optimizer state dict")
    if rank0_only:
        refuse_rank0_only_with_dtensors(root, "load_optim_state_dict")
    entries = optimizer_entries(root, optimizer)
    is_source = not rank0_only or is_rank0(root)
    layout = _layout_or_error(osd) if is_source else None
    if rank0_only:  # every rank raises the same error, none waits for rank 0
        layout = broadcast_object_from_rank0(root, layout)
    if isinstance(layout, Exception):
        raise layout
    groups, kinds = layout
    held = held_names(root, optimizer, entries)
    check_known(held, kinds)
    check_groups(held, groups)
    check_saved_shapes(root, kinds)  # on every rank: an entry sees only its own names
    layouts = [entry_state_keys(e, kinds) for e in entries]  # all checks before any write
    per_entry: list[dict[str, Any]] = []
    for e, keys in zip(entries, layouts, strict=True):
        state = {}
        for key, (sharded, dtype, value) in keys.items():
            # a copy per entry: AdamW increments step in place
            state[key] = (
                _state_tensor(optimizer, e, key, dtype) if sharded else copy.deepcopy(value)
            )
        per_entry.append(state)
    names = param_names(root)
    for flat in flat_params(root):
        for key, (dtype, present) in saved_sharded_keys(flat, names, kinds).items():
            if is_source:  # a DTensor parameter's local part of the whole value
                values = {
                    i: flat.slots[i].local_value(osd["state"][names[id(flat.slots[i])]][key])
                    for i in present
                }
            else:
                values = {}
            if rank0_only:
                values = broadcast_slots(root, flat, values, present, dtype)
            for e, keys, state in zip(entries, layouts, per_entry, strict=True):
                if e.flat is flat and keys.get(key, (False,))[0]:
                    write_entry(state[key], e, values)
    apply_shard_state(optimizer, entries, per_entry, groups)


def saved_sharded_keys(
    flat: FlatParam, names: dict[int, str], kinds: dict
) -> dict[str, tuple[torch.dtype, list[int]]]:
    """key -> (dtype, slot indices) for keys saved for parameters of ``flat`` as tensors
    of the parameter's shape (sorted: the same order on every rank)."""
    keys: dict[str, tuple[torch.dtype, list[int]]] = {}
    for i, slot in enumerate(flat.slots):
        for key, kind in kinds.get(names[id(slot)], {}).items():
            if key != "step" and kind[0] == "tensor" and tuple(kind[1]) == tuple(slot.full_shape):
                keys.setdefault(key, (kind[2], []))[1].append(i)
    return dict(sorted(keys.items()))


def write_entry(target: torch.Tensor, e: Entry, values: dict[int, torch.Tensor]) -> None:
    """Copy this rank's part of each covered slot's full value (``values[slot index]``)
    into ``target``, the entry-shaped state tensor."""
    flat_target = target.view(-1)
    end = e.at + flat_target.numel()
    for i, lo, hi, at in e.flat.pieces():
        if i in values and i in e.slots and e.at <= at < end:
            flat_target[at - e.at : at - e.at + hi - lo].copy_(values[i].reshape(-1)[lo:hi])


def held_names(
    root: nn.Module, optimizer: torch.optim.Optimizer, entries: list[Entry]
) -> list[set[str]]:
    """Per param group, the names the optimizer holds on any rank (collective)."""
    mine = [
        {n for e in entries if e.group == gi for n in e.names}
        for gi in range(len(optimizer.param_groups))
    ]
    everyone = collectives.all_gather_object(mine, root.process_group)
    if len({len(groups) for groups in everyone}) > 1:
        raise ValueError(
            f"optimizer param groups differ between ranks (counts {[len(g) for g in everyone]}): "
            "build the same groups on every rank"
        )
    return [set().union(*(groups[gi] for groups in everyone)) for gi in range(len(mine))]


def _state_tensor(
    optimizer: torch.optim.Optimizer, e: Entry, key: str, dtype: torch.dtype
) -> torch.Tensor:
    """Where to load a sharded state value: the optimizer's own tensor when it has a
    matching one (no second copy of the optimizer state), else a new one."""
    current = optimizer.state.get(e.param, {}).get(key)
    if torch.is_tensor(current) and current.shape == e.param.shape and current.dtype == dtype:
        return current
    return torch.zeros(e.param.shape, dtype=dtype, device=e.param.device)


def _layout_or_error(osd: OptimStateDict) -> tuple | Exception:
    try:
        return _layout(osd)
    except (ValueError, TypeError, AttributeError) as exc:
        return exc


def _layout(osd: OptimStateDict) -> tuple[list[dict], dict[str, dict[str, tuple]]]:
    """What every rank needs to know of a full optimizer state dict: its param groups
    and, per name and key, a kind (see ``flat_state_keys``)."""
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        got = list(osd)[:5] if isinstance(osd, dict) else type(osd).__name__
        raise ValueError(
            "not an optimizer state dict: expected {'state': {name: {...}}, 'param_groups': "
            f"[...]}} as from fsdp_lite.full_optim_state_dict, got {got}"
        )
    kinds = {n: {k: value_kind(v) for k, v in st.items()} for n, st in osd["state"].items()}
    return list(osd["param_groups"]), kinds


def value_kind(value: Any) -> tuple:
    """``("tensor", shape, dtype, value if 0-dim else None)`` or ``("value", value)``."""
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), value.dtype, value if value.dim() == 0 else None)
    return ("value", value)


def entry_state_keys(
    e: Entry, kinds: dict[str, dict[str, tuple]]
) -> dict[str, tuple[bool, torch.dtype | None, Any]]:
    """key -> (sharded, dtype, replicated value) for one entry, from the kinds of its
    parameters' saved state. A key is sharded when every parameter's value is a tensor of
    that parameter's shape (``step`` excepted); a tensor of positive dimension must have
    its parameter's shape."""
    slots = [e.flat.slots[i] for i in e.slots]
    saved = [kinds.get(n) for n in e.names]
    present = [n for n, s in zip(e.names, saved, strict=True) if s is not None]
    if not present:
        return {}
    if len(present) != len(e.names) or any(set(s) != set(saved[0]) for s in saved):
        raise RuntimeError(
            f"optimizer state covers {present} with keys {[sorted(s or {}) for s in saved]}, "
            f"but {e.names} share one optimizer parameter (a flat param's shard) and need the same "
            "keys: a partial optimizer state cannot be loaded"
        )
    keys: dict[str, tuple[bool, torch.dtype | None, Any]] = {}
    for key in saved[0]:
        per_slot = [s[key] for s in saved]
        for slot, name, kind in zip(slots, e.names, per_slot, strict=True):
            if (
                kind[0] == "tensor"
                and len(kind[1]) > 0
                and tuple(kind[1]) != tuple(slot.full_shape)
            ):
                raise RuntimeError(
                    f"optimizer state '{key}' of '{name}' has shape {kind[1]}, "
                    f"the parameter {tuple(slot.full_shape)}"
                )
        shaped = all(
            k[0] == "tensor" and tuple(k[1]) == tuple(s.full_shape)
            for k, s in zip(per_slot, slots, strict=True)
        )
        if shaped and key != "step":
            keys[key] = (True, per_slot[0][2], None)
        else:
            first = per_slot[0]
            keys[key] = (False, None, first[3] if first[0] == "tensor" else first[1])
    return keys


def apply_shard_state(
    optimizer: torch.optim.Optimizer,
    entries: list[Entry],
    per_flat: list[dict[str, Any]],
    saved_groups: list[dict],
) -> None:
    """Load ``per_flat`` (the state of each entry, in optimizer order) with the saved
    hyperparameters (the groups were checked by ``check_groups``)."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one "
            f"{len(optimizer.param_groups)}: build the optimizer with the same groups"
        )
    state, groups, index = {}, [], 0
    for gi, group in enumerate(optimizer.param_groups):
        ids = list(range(index, index + len(group["params"])))
        for i in ids:
            if per_flat[i]:
                state[i] = per_flat[i]
        index += len(ids)
        hyper = {k: v for k, v in saved_groups[gi].items() if k != "params"}
        groups.append({**hyper, "params": ids})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    previous = [dict(optimizer.state.get(p, {})) for p in params]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    _keep_storage(optimizer, params, previous)


@torch.no_grad()
def _keep_storage(optimizer: torch.optim.Optimizer, params: list, previous: list[dict]) -> None:
    """Copy loaded state into the tensors it replaces, where they match: state that has a
    home of its own (memory-mapped by SSD offload, pinned) keeps it."""
    for p, old_state in zip(params, previous, strict=True):
        new_state = optimizer.state.get(p, {})
        for key, old in old_state.items():
            new = new_state.get(key)
            same = torch.is_tensor(old) and torch.is_tensor(new) and new is not old
            if same and (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device):
                old.copy_(new)
                new_state[key] = old


def check_saved_shapes(root: nn.Module, kinds: dict[str, dict[str, tuple]]) -> None:
    """A saved state tensor of positive dimension must have its parameter's shape."""
    names = param_names(root)
    for flat in flat_params(root):
        for slot in flat.slots:
            for key, kind in kinds.get(names[id(slot)], {}).items():
                if (
                    kind[0] == "tensor"
                    and len(kind[1])
                    and tuple(kind[1]) != tuple(slot.full_shape)
                ):
                    raise RuntimeError(
                        f"optimizer state '{key}' of '{names[id(slot)]}' has shape {kind[1]}, "
                        f"the parameter {tuple(slot.full_shape)}"
                    )


def _misshapen(kind: tuple, slot: ParamSlot) -> bool:
    """A saved state tensor of positive dimension whose shape is not its parameter's."""
    return kind[0] == "tensor" and len(kind[1]) > 0 and tuple(kind[1]) != tuple(slot.full_shape)


def check_known(held: list[set[str]], names: Any) -> None:
    unknown = sorted(set(names) - set().union(*held))
    if unknown:
        raise RuntimeError(
            f"optimizer state for parameters this optimizer does not hold: {unknown[:5]} "
            "(a checkpoint of another model, or an optimizer built over fewer parameters?)"
        )


def check_groups(held: list[set[str]], saved_groups: list[dict]) -> None:
    if len(saved_groups) != len(held):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one "
            f"{len(held)}: build the optimizer with the same groups"
        )
    for gi, (saved, want) in enumerate(zip(saved_groups, held, strict=True)):
        got = set(saved["params"])
        if want != got:
            raise ValueError(
                f"param group {gi} holds different parameters in the checkpoint than in this "
                f"optimizer (only in the checkpoint: {sorted(got - want)[:4]}, only here: "
                f"{sorted(want - got)[:4]}). Build the groups from the same parameters; by "
                "default fsdp_lite puts each flat param (a unit's parameters of one dtype) in "
                "one group (optimizer_params='pieces': per parameter)"
            )
