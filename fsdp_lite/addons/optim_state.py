"""Optimizer state keyed by original parameter names, with original shapes.

The optimizer of an ``FSDPModule`` steps the shards, so its state (AdamW's ``exp_avg``,
``exp_avg_sq``) is shard-shaped and 1-D. Here it is translated to and from the
unwrapped model's view: ``{"state": {name: {"step": t, "exp_avg": Tensor[shape], ...}},
"param_groups": [{"lr": ..., "params": [name, ...]}, ...]}`` -- ``Optimizer.state_dict()``
of the plain model with parameter names in place of indices, which does not depend on
the world size.

[Note: param groups hold whole flat params]
A flat param is one optimizer parameter, so it sits in exactly one param group and
every original parameter inside it shares that group's hyperparameters. A flat param
holds one unit's parameters of one (dtype, requires_grad, compute dtype): a Linear's
weight and bias land together. To give norms no weight decay, make them their own
units (``wrap.by_type(Block, nn.LayerNorm)``) and put those units' shards in their own
group. A saved group records its hyperparameters and the names of its parameters;
loading requires each group of the target optimizer to hold exactly those names
(same wrapping, any world size) and raises naming the difference otherwise.

[Note: which state is sharded]
A state tensor of the shard's shape (1-D, ``shard_numel``) is sharded: it is gathered
and cut into original-shape tensors per parameter. Anything else (``step``, 0-dim
tensors, Python numbers) is per flat param and copied to each of its parameters.
Loading reverses this (``flat_state_keys``): a key whose value is a tensor of the
parameter's shape for every parameter of a flat param is sharded.
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
    write_shard,
)
from fsdp_lite.core import collectives
from fsdp_lite.core.flat_param import FlatParam

OptimStateDict = dict[str, Any]


@dataclass
class FlatEntry:
    """One optimizer parameter (a shard) and what it stands for."""

    flat: FlatParam
    names: list[str]  # the original parameter name of each slot
    group: int  # index into optimizer.param_groups
    state: dict[str, Any]  # this rank's optimizer state of flat.shard (shard-shaped tensors)


def optimizer_entries(root: nn.Module, optimizer: torch.optim.Optimizer) -> list[FlatEntry]:
    """The optimizer's parameters in its own order, each matched to its flat param."""
    by_shard = {id(f.shard): f for f in flat_params(root)}
    names = param_names(root)
    entries = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            flat = by_shard.get(id(p))
            if flat is None:
                raise ValueError(
                    f"optimizer param group {gi} holds a parameter of shape {tuple(p.shape)} "
                    "that is not a shard of this model: build the optimizer from "
                    "model.parameters() after wrapping"
                )
            state = optimizer.state.get(p, {})
            entries.append(FlatEntry(flat, [names[id(s)] for s in flat.slots], gi, state))
    return entries


def is_sharded(value: Any, flat: FlatParam) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == flat.shard_numel


def group_records(optimizer: torch.optim.Optimizer, entries: list[FlatEntry]) -> list[dict]:
    """Each param group's hyperparameters, with the names of its parameters as ``params``."""
    records = []
    for gi, group in enumerate(optimizer.param_groups):
        names = [n for e in entries if e.group == gi for n in e.names]
        records.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return records


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
    group = root.process_group
    _check_same_state_layout(entries, group)
    keep = not rank0_only or is_rank0(root)
    state: dict[str, dict[str, Any]] = {}
    for e in entries:
        for key, value in e.state.items():
            _consolidate(e, key, value, state if keep else None)
    if not keep:
        return {}
    order = list(param_names(root).values())
    state = {n: state[n] for n in order if n in state}
    return {"state": state, "param_groups": group_records(optimizer, entries)}


def _consolidate(e: FlatEntry, key: str, value: Any, state: dict | None) -> None:
    """Cut one state value of a flat param into per-parameter CPU values in ``state``
    (``None``: only take part in the gather). The gathered copy dies on return."""
    sharded = is_sharded(value, e.flat)
    if sharded:
        full = torch.empty(e.flat.padded_numel, dtype=value.dtype, device=value.device)
        collectives.all_gather_flat(full, value.detach(), e.flat.group)
    if state is None:
        return
    for slot, name in zip(e.flat.slots, e.names, strict=True):
        if sharded:
            piece = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
            state.setdefault(name, {})[key] = piece.to("cpu", copy=True)
        elif torch.is_tensor(value):
            state.setdefault(name, {})[key] = value.detach().to("cpu", copy=True)
        else:
            state.setdefault(name, {})[key] = value


def _check_same_state_layout(entries: list[FlatEntry], group: collectives.ProcessGroup) -> None:
    """Every rank must hold the same state keys, or the per-key gathers would hang."""
    mine = [sorted(e.state) for e in entries]
    layouts = collectives.all_gather_object(mine, group)
    for r, layout in enumerate(layouts):
        if layout != mine:
            raise RuntimeError(
                f"optimizer state differs between ranks (this rank {mine}, rank {r} {layout}): "
                "every rank must step the same optimizer over the same model"
            )


@torch.no_grad()
def load_full_optim_state_dict(
    root: nn.Module,
    optimizer: torch.optim.Optimizer,
    osd: OptimStateDict,
    rank0_only: bool = False,
) -> None:
    """Load a full, name-keyed optimizer state dict into the sharded ``optimizer``.

    Works at any world size. Without ``rank0_only`` every rank passes the same dict and
    nothing is communicated; with it only rank 0's dict is read and each state tensor is
    broadcast one flat param at a time. Load the model's parameters separately.
    """
    check_idle(root, "load an optimizer state dict")
    entries = optimizer_entries(root, optimizer)
    is_source = not rank0_only or is_rank0(root)
    layout = _layout_or_error(osd) if is_source else None
    if rank0_only:  # every rank raises the same error, none waits for rank 0
        layout = broadcast_object_from_rank0(root, layout)
    if isinstance(layout, Exception):
        raise layout
    groups, kinds = layout
    check_known(entries, kinds)
    check_groups(optimizer, entries, groups)
    layouts = [flat_state_keys(e, kinds) for e in entries]  # all checks before any write
    per_flat = []
    for e, keys in zip(entries, layouts, strict=True):
        state: dict[str, Any] = {}
        for key, (sharded, dtype, value) in keys.items():
            if not sharded:  # a copy per flat param: AdamW increments step in place
                state[key] = copy.deepcopy(value)
                continue
            values = {i: osd["state"][n][key] for i, n in enumerate(e.names)} if is_source else {}
            if rank0_only:
                values = broadcast_slots(root, e.flat, values, list(range(len(e.names))), dtype)
            state[key] = _state_tensor(optimizer, e, key, dtype)
            write_shard(state[key], e.flat, values)
        per_flat.append(state)
    apply_shard_state(optimizer, entries, per_flat, groups)


def _state_tensor(
    optimizer: torch.optim.Optimizer, e: FlatEntry, key: str, dtype: torch.dtype
) -> torch.Tensor:
    """Where to load a sharded state value: the optimizer's own tensor when it has a
    matching one (no second copy of the optimizer state), else a new one."""
    current = optimizer.state.get(e.flat.shard, {}).get(key)
    if torch.is_tensor(current) and current.shape == e.flat.shard.shape and current.dtype == dtype:
        return current
    return torch.zeros(e.flat.shard_numel, dtype=dtype, device=e.flat.shard.device)


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


def flat_state_keys(
    e: FlatEntry, kinds: dict[str, dict[str, tuple]]
) -> dict[str, tuple[bool, torch.dtype | None, Any]]:
    """key -> (sharded, dtype, replicated value) for one flat param, from the kinds of its
    parameters' saved state. A key is sharded when every parameter's value is a tensor of
    that parameter's shape (``step`` of 0-dim parameters excepted); a tensor of positive
    dimension must have its parameter's shape."""
    saved = [kinds.get(n) for n in e.names]
    present = [n for n, s in zip(e.names, saved, strict=True) if s is not None]
    if not present:
        return {}
    if len(present) != len(e.names) or any(set(s) != set(saved[0]) for s in saved):
        raise RuntimeError(
            f"optimizer state covers {present} with keys {[sorted(s or {}) for s in saved]}, "
            f"but {e.names} share one flat param (one optimizer parameter) and need the same "
            "keys: a partial optimizer state cannot be loaded"
        )
    keys: dict[str, tuple[bool, torch.dtype | None, Any]] = {}
    for key in saved[0]:
        per_slot = [s[key] for s in saved]
        for slot, name, kind in zip(e.flat.slots, e.names, per_slot, strict=True):
            if kind[0] == "tensor" and len(kind[1]) > 0 and tuple(kind[1]) != tuple(slot.shape):
                raise RuntimeError(
                    f"optimizer state '{key}' of '{name}' has shape {kind[1]}, "
                    f"the parameter {tuple(slot.shape)}"
                )
        shaped = all(
            k[0] == "tensor" and tuple(k[1]) == tuple(s.shape)
            for k, s in zip(per_slot, e.flat.slots, strict=True)
        )
        scalar_step = key == "step" and all(len(s.shape) == 0 for s in e.flat.slots)
        if shaped and not scalar_step:
            keys[key] = (True, per_slot[0][2], None)
        else:
            first = per_slot[0]
            keys[key] = (False, None, first[3] if first[0] == "tensor" else first[1])
    return keys


def apply_shard_state(
    optimizer: torch.optim.Optimizer,
    entries: list[FlatEntry],
    per_flat: list[dict[str, Any]],
    saved_groups: list[dict],
) -> None:
    """Check the saved param groups against the optimizer's, then load ``per_flat`` (the
    shard-shaped state of each entry, in optimizer order) with the saved hyperparameters."""
    check_groups(optimizer, entries, saved_groups)
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


def check_known(entries: list[FlatEntry], names: Any) -> None:
    unknown = sorted(set(names) - {n for e in entries for n in e.names})
    if unknown:
        raise RuntimeError(
            f"optimizer state for parameters this optimizer does not hold: {unknown[:5]} "
            "(a checkpoint of another model, or an optimizer built over fewer parameters?)"
        )


def check_groups(
    optimizer: torch.optim.Optimizer, entries: list[FlatEntry], saved_groups: list[dict]
) -> None:
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one "
            f"{len(optimizer.param_groups)}: build the optimizer with the same groups"
        )
    for gi, saved in enumerate(saved_groups):
        want = {n for e in entries if e.group == gi for n in e.names}
        got = set(saved["params"])
        if want != got:
            raise ValueError(
                f"param group {gi} holds different parameters in the checkpoint than in this "
                f"optimizer (only in the checkpoint: {sorted(got - want)[:4]}, only here: "
                f"{sorted(want - got)[:4]}). Build the groups from the same parameters; "
                "fsdp_lite puts each flat param (a unit's parameters of one dtype) in one group"
            )
