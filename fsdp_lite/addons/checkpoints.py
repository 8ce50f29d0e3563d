"""Sharded checkpoints: atomic, written in parallel, resharded on load.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory. Every rank writes
only its own shards -- nothing is gathered -- and any world size reads it back. Keys:

    model.<key>               every key of ``model.state_dict()``, original shapes, fp32
                              (buffers, replicated, as rank 0 holds them)
    optim.param_groups        [{hyperparameters..., "params": [parameter names]}]
    optim.state.<name>.<key>  e.g. ``exp_avg`` with the parameter's shape, ``step``
    extra.rank<r>             the ``extra`` rank r passed to ``save_checkpoint``
    fsdp_lite                 {"format": 1, "shards": W, "optimizer": bool}

so a user without fsdp_lite can read it with ``dcp.load`` into a plain model's
``state_dict()`` under ``model.`` keys.

[Note: a shard is a few boxes of the original parameter]
A rank's shard is a contiguous 1-D range of the flattened parameters. Within one
parameter of shape (R, C) that range is at most three rectangles: the tail of one row,
whole rows, the head of a row (for N dims, at most 2N-1 boxes; see ``boxes``). Each box
is contiguous in the shard, so it is a view, not a copy. Every rank describes its boxes
with original-shape offsets as the local shards of a ``ShardedTensor`` (DCP's
multi-chunk tensor); DCP records them and, on load, intersects the boxes saved at one
world size with those requested at another. 0-dim parameters are broadcast from their
owner and saved whole.

Writing is atomic: see ``atomic_dir``.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fsdp_lite.addons import atomic_dir
from fsdp_lite.addons import optim_state as _optim
from fsdp_lite.addons.state_dict import (
    boxes,
    check_idle,
    expected_shapes,
    state_dict_layout,
    validate_keys,
    write_shard,
)
from fsdp_lite.core import collectives
from fsdp_lite.core.flat_param import FlatParam
from fsdp_lite.core.tree import units_of

FORMAT = 1
MARKER = "fsdp_lite"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, foreign or does not match the model."""


@contextlib.contextmanager
def _quiet_sharded_tensor():
    """ShardedTensor warns that DTensor replaces it; DTensor cannot describe a flat shard's
    uneven boxes, and DCP reads both, so the warning is noise for fsdp_lite's users."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        yield


# -- a shard as ShardedTensors ------------------------------------------------------


def _sharded_tensor(flat: FlatParam, i: int, src: torch.Tensor) -> ShardedTensor:
    """Slot ``i`` of ``flat`` as a ShardedTensor whose local shards view the shard-shaped
    ``src`` (no communication: every rank computes every rank's boxes)."""
    slot, sn = flat.slots[i], flat.shard_numel
    ranks = collectives.global_ranks(flat.group)
    metas, local = [], []
    first_rank, last_rank = slot.offset // sn, (slot.offset + slot.numel - 1) // sn
    for q in range(first_rank, last_rank + 1):
        lo = max(q * sn, slot.offset) - slot.offset
        hi = min((q + 1) * sn, slot.offset + slot.numel) - slot.offset
        at = slot.offset + lo - q * sn  # where element lo sits in rank q's shard
        for offsets, sizes, first in boxes(tuple(slot.shape), lo, hi):
            md = ShardMetadata(list(offsets), list(sizes), f"rank:{ranks[q]}/{src.device}")
            metas.append(md)
            if q == flat.rank:
                start = at + first - lo
                local.append(Shard(src[start : start + math.prod(sizes)].view(sizes), md))
    props = TensorProperties(dtype=src.dtype, requires_grad=False)
    meta = ShardedTensorMetadata(metas, torch.Size(slot.shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, meta, process_group=flat.group
    )


def _whole(flat: FlatParam, i: int, src: torch.Tensor) -> torch.Tensor:
    """A small slot (0-dim or empty) in full on every rank: broadcast from its owner."""
    slot = flat.slots[i]
    value = torch.zeros(slot.numel, dtype=src.dtype, device=src.device)
    if slot.numel:
        owner = flat.owner(slot.offset)
        if owner == flat.rank:
            start = slot.offset - flat.rank_range()[0]
            value.copy_(src[start : start + slot.numel])
        collectives.broadcast(value, flat.group, src_rank=owner)
    return value.view(slot.shape)


def _save_value(flat: FlatParam, i: int, src: torch.Tensor) -> Any:
    if len(flat.slots[i].shape) == 0 or flat.slots[i].numel == 0:
        return _whole(flat, i, src.detach())
    return _sharded_tensor(flat, i, src.detach())


def _load_dest(flat: FlatParam, i: int, scratch: torch.Tensor, after: list[Callable]) -> Any:
    """Where DCP should read slot ``i`` so that its part lands in ``scratch``."""
    slot = flat.slots[i]
    if len(slot.shape) and slot.numel:
        return _sharded_tensor(flat, i, scratch)
    whole = torch.zeros(slot.shape, dtype=scratch.dtype, device=scratch.device)
    after.append(lambda: write_shard(scratch, flat, {i: whole}))
    return whole


# -- what goes into a checkpoint ----------------------------------------------------


def _model_items(model: nn.Module) -> dict[str, Any]:
    slots, tensors = state_dict_layout(model)
    items = {f"model.{k}": _save_value(flat, i, flat.shard) for k, (flat, i) in slots.items()}
    for key, (tensor, dtype) in tensors.items():
        items[f"model.{key}"] = tensor.detach().to(dtype)
    return items


def _optim_items(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    entries = _optim.optimizer_entries(model, optimizer)
    items: dict[str, Any] = {"optim.param_groups": _optim.group_records(optimizer, entries)}
    for e in entries:
        for key, value in e.state.items():
            for i, name in enumerate(e.names):
                if _optim.is_sharded(value, e.flat):
                    items[f"optim.state.{name}.{key}"] = _save_value(e.flat, i, value)
                else:
                    items[f"optim.state.{name}.{key}"] = value
    return items


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write a sharded DCP checkpoint of ``model`` (and ``optimizer``) to the directory
    ``path``, atomically. Call on every rank; each writes only its own shards.

    ``extra`` is any picklable dict of this rank's (step, RNG states, data position,
    scheduler state...); ``load_checkpoint`` returns it. An existing checkpoint at
    ``path`` is replaced only once the new one is complete: a crash, even ``kill -9``,
    at any point leaves one complete checkpoint loadable from ``path``.
    """
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"save_checkpoint: extra must be a dict, got {type(extra).__name__}")
    check_idle(model, "save a checkpoint")
    group = _checkpoint_group(model)
    path = os.fspath(path)
    tmp = path + ".tmp"
    with _quiet_sharded_tensor():
        items = _model_items(model)
        if optimizer is not None:
            items.update(_optim_items(model, optimizer))
        items[f"extra.rank{collectives.rank(group)}"] = dict(extra or {})
        shards = collectives.world_size(model.process_group)
        items[MARKER] = {"format": FORMAT, "shards": shards, "optimizer": optimizer is not None}
        _on_rank0(group, atomic_dir.prepare, path, tmp)
        dcp.save(
            items,
            storage_writer=dcp.FileSystemWriter(tmp),
            planner=DefaultSavePlanner(
                flatten_state_dict=False,
                flatten_sharded_tensors=False,
                dedup_save_to_lowest_rank=True,  # replicated values (buffers): rank 0's
            ),
            process_group=group,
        )
    _on_rank0(group, atomic_dir.publish, tmp, path)


def _checkpoint_group(model: nn.Module) -> collectives.ProcessGroup:
    """The ranks that save and load together: the shard group or, with hybrid sharding,
    every replica's ranks (each box is then written once, by one replica)."""
    replicate = getattr(model, "replicate_group", None)
    if replicate is None:
        return model.process_group
    world = collectives.resolve_group(None)
    sizes = collectives.world_size(model.process_group) * collectives.world_size(replicate)
    if sizes != collectives.world_size(world):
        raise CheckpointError(
            "hybrid sharding: checkpoints need shard and replicate groups that together span "
            "the world (as from fsdp_lite.hybrid_groups)"
        )
    return world


def _on_rank0(group: collectives.ProcessGroup, fn: Callable, *args: Any) -> None:
    """Run ``fn`` on rank 0; every rank raises if it failed (so none waits forever)."""
    error = None
    if collectives.rank(group) == 0:
        try:
            fn(*args)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    error = collectives.broadcast_object(error, group)
    if error is not None:
        raise CheckpointError(f"checkpoint directory operation failed on rank 0: {error}")


# -- loading --------------------------------------------------------------------


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Restore ``model`` (and ``optimizer``) in place from a ``save_checkpoint`` directory
    written at any world size; return the ``extra`` dict this rank saved (rank 0's when
    the checkpoint was written by fewer ranks). Call on every rank.

    The checkpoint must hold exactly the model's keys and shapes, and the optimizer's
    parameter groups (see ``fsdp_lite.addons.optim_state``); otherwise, or if the directory is
    incomplete or not an fsdp_lite checkpoint, ``CheckpointError`` is raised on every
    rank before anything is loaded. ``extra`` is unpickled: load only checkpoints you trust.
    """
    check_idle(model, "load a checkpoint")
    path = _existing_checkpoint(os.fspath(path))
    keys = _read_metadata(path).state_dict_metadata
    group = _checkpoint_group(model)
    rank = collectives.rank(group)
    extra_key = f"extra.rank{rank}" if f"extra.rank{rank}" in keys else "extra.rank0"
    after: list[Callable] = []
    with _quiet_sharded_tensor():
        dest, apply_model = _model_dest(model, keys, after)
        apply_optim = None
        if optimizer is not None and "optim.param_groups" not in keys:
            raise CheckpointError(f"{path} holds no optimizer state (saved without optimizer=)")
        if optimizer is not None:
            optim_dest, apply_optim = _optim_dest(model, optimizer, keys, after)
            dest.update(optim_dest)
        dest[extra_key] = None
        dcp.load(
            dest,
            storage_reader=dcp.FileSystemReader(path),
            planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            process_group=group,
        )
    for fn in after:
        fn()
    if apply_optim is not None:  # first: it checks the param groups before loading anything
        apply_optim(dest)
    apply_model()
    return dest[extra_key]


def _existing_checkpoint(path: str) -> str:
    found = atomic_dir.committed(path)
    if found is None:
        raise CheckpointError(f"no checkpoint at {path}")
    return found


def _read_metadata(path: str) -> Metadata:
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no .metadata): a save that did not finish "
            "leaves a '<path>.tmp' directory, never a checkpoint at <path>"
        )
    metadata = dcp.FileSystemReader(path).read_metadata()
    if MARKER not in metadata.state_dict_metadata:
        found = sorted(metadata.state_dict_metadata)[:5]
        raise CheckpointError(
            f"{path} is a DCP checkpoint but not one written by fsdp_lite.save_checkpoint "
            f"(no '{MARKER}' entry; keys start {found})"
        )
    for info in (metadata.storage_data or {}).values():
        file = os.path.join(path, info.relative_path)
        if not os.path.exists(file) or os.path.getsize(file) < info.offset + info.length:
            raise CheckpointError(f"{path} is incomplete: {info.relative_path} is missing or short")
    return metadata


def _model_dest(model: nn.Module, keys: dict, after: list[Callable]):
    shapes = {
        k.removeprefix("model."): tuple(md.size)
        for k, md in keys.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    hint = "the checkpoint is of another model (or another version of it)"
    try:
        validate_keys(expected_shapes(model), shapes, True, "load_checkpoint", hint=hint)
    except RuntimeError as exc:
        raise CheckpointError(str(exc)) from None
    slots, tensors = state_dict_layout(model)
    scratch = {id(f): torch.zeros_like(f.shard.detach()) for f, _ in slots.values()}
    dest: dict[str, Any] = {}
    for key, (flat, i) in slots.items():
        dest[f"model.{key}"] = _load_dest(flat, i, scratch[id(flat)], after)
    for key, (tensor, dtype) in tensors.items():
        dest[f"model.{key}"] = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)

    @torch.no_grad()
    def apply() -> None:
        for unit in units_of(model):
            unit.reshard()  # full params kept by reshard_after_forward=False would go stale
        for flat, _ in slots.values():
            flat.home.before_host_write(flat)
            flat.shard.copy_(scratch[id(flat)])
        for key, (tensor, _) in tensors.items():
            tensor.copy_(dest[f"model.{key}"])

    return dest, apply


def _optim_dest(model: nn.Module, optimizer: torch.optim.Optimizer, keys: dict, after: list):
    entries = _optim.optimizer_entries(model, optimizer)
    kinds: dict[str, dict[str, tuple]] = {}
    for key, md in keys.items():
        if key.startswith("optim.state."):
            name, state_key = key.removeprefix("optim.state.").rsplit(".", 1)
            kind = ("tensor", tuple(md.size), md.properties.dtype, None)
            is_tensor = isinstance(md, TensorStorageMetadata)
            kinds.setdefault(name, {})[state_key] = kind if is_tensor else ("value", None)
    try:
        _optim.check_known(entries, kinds)
        layouts = [_optim.flat_state_keys(e, kinds) for e in entries]
    except RuntimeError as exc:
        raise CheckpointError(str(exc)) from None
    dest: dict[str, Any] = {"optim.param_groups": None}
    per_flat: list[dict[str, Any]] = []
    for e, layout in zip(entries, layouts, strict=True):
        state: dict[str, Any] = {}
        for key, (sharded, dtype, _) in layout.items():
            if sharded:
                state[key] = torch.zeros_like(e.flat.shard.detach(), dtype=dtype)
                for i, name in enumerate(e.names):
                    dest[f"optim.state.{name}.{key}"] = _load_dest(e.flat, i, state[key], after)
            else:
                md = keys[f"optim.state.{e.names[0]}.{key}"]
                is_tensor = isinstance(md, TensorStorageMetadata)
                value = torch.empty(md.size, dtype=md.properties.dtype) if is_tensor else None
                dest[f"optim.state.{e.names[0]}.{key}"] = value
                state[key] = f"optim.state.{e.names[0]}.{key}"  # filled in after the load
        per_flat.append(state)

    def apply(loaded: dict[str, Any]) -> None:
        for layout, state in zip(layouts, per_flat, strict=True):
            for key, (sharded, _, _) in layout.items():
                if not sharded:
                    state[key] = loaded[state[key]]
        try:
            _optim.apply_shard_state(optimizer, entries, per_flat, loaded["optim.param_groups"])
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None

    return dest, apply
