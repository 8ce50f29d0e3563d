"""Sharded checkpoints: atomic, written in parallel, resharded on load.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory. Every rank writes
only its own shards -- nothing is gathered -- and any world size reads it back. Keys:

    model.<key>                   every key of ``model.state_dict()``, original shapes, fp32
                                  (buffers, replicated, as rank 0 holds them)
    optim.param_groups.<i>.<hp>   group i's hyperparameters, and ``params``: their names
    optim.state.<name>.<key>      e.g. ``exp_avg`` with the parameter's shape, ``step``
    optim<k>.*                    the same for the k-th of several optimizers (k >= 1)
    extra.rank<r>                 the ``extra`` rank r passed to ``save_checkpoint``
    fsdp_lite                     {"format": 2, "shards": W, "optimizers": count}

-- the layout ``torch.distributed.checkpoint`` gives ``{"model": get_model_state_dict(m),
"optim": get_optimizer_state_dict(m, opt)}``, so PyTorch FSDP2 (and a plain model, with
``dcp.load``) reads it, and ``load_checkpoint`` reads what FSDP2 and torchtitan write: model
keys under ``model.`` or none (a weights-only export), optimizer state under ``optim.`` or
``optimizer.``, its groups per index or, flattened by ``flatten_optimizer_state_dict``, per
parameter name. Format 1 (fsdp_lite before) kept each optimizer's groups as one object.

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
import functools
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
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
    IncompatibleKeys,
    boxes,
    check_idle,
    expected_shapes,
    flat_params,
    param_names,
    state_dict_layout,
    validate_keys,
)
from fsdp_lite.core import collectives
from fsdp_lite.core.flat_param import FlatParam, ParamSlot, even_bounds
from fsdp_lite.core.tree import units_of

FORMAT = 2
MARKER = "fsdp_lite"
# Keys of what other programs save beside the model (torchtitan): never model keys.
_NOT_MODEL = ("optim.", "optimizer.", "extra.", "lr_scheduler", "dataloader", "train_state")


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


# This rank's elements [start, start + numel) of a shard-shaped value, as a 1-D view: of
# a shard-shaped tensor (``_of``), or of the optimizer state of the entry holding them.
Local = Callable[[int, int], torch.Tensor]


def _of(src: torch.Tensor) -> Local:
    return lambda start, numel: src[start : start + numel]


def _sharded_tensor(
    flat: FlatParam, i: int, local: Local, dtype: torch.dtype, device: torch.device | None = None
) -> ShardedTensor:
    """Slot ``i`` of ``flat`` as a ShardedTensor whose local shards view ``local`` (no
    communication: every rank computes every rank's boxes), on ``device`` (default: the
    shard's). A DTensor parameter's boxes are laid out in its global tensor: those of every
    coordinate of its mesh (``_boxes_at``), so that the metadata covers the whole tensor."""
    slot, device = flat.slots[i], device or flat.shard.device
    ranks = collectives.global_ranks(flat.group)
    coordinates = [None] if slot.layout is None else slot.layout.coordinates()
    metas, shards = [], []
    for coordinate in coordinates:
        for q, offsets, sizes, at, mine in _boxes_at(flat, i, coordinate):
            # Only this rank's own entries are read: others name a rank of the world
            # holding the same dp shard (q) or the same coordinate, never this one.
            owner = ranks[q] if mine or coordinate is None else _rank_at(slot, coordinate)
            md = ShardMetadata(list(offsets), list(sizes), f"rank:{owner}/{device}")
            metas.append(md)
            if mine and q == flat.rank:
                shards.append(Shard(local(at, math.prod(sizes)).view(sizes), md))
    props = TensorProperties(dtype=dtype, requires_grad=False)
    meta = ShardedTensorMetadata(metas, torch.Size(slot.full_shape), props)
    group = flat.group if slot.layout is None else None  # the world: every rank named
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, meta, process_group=group
    )


def _boxes_at(flat: FlatParam, i: int, coordinate: tuple[int, ...] | None) -> Iterator[tuple]:
    """``(dp rank q, global offsets, sizes, where in q's shard, is this coordinate's)`` for
    every box of slot ``i`` that dp rank ``q`` holds, at ``coordinate`` of the slot's mesh
    (None: a plain slot, laid out as this rank's flat param is)."""
    slot = flat.slots[i]
    if coordinate is None:
        offsets, bounds, part = [s.offset for s in flat.slots], flat.bounds, None
    else:  # the flat param of the ranks at that coordinate: local sizes differ (uneven TP)
        if flat.whole:
            raise NotImplementedError(
                "a checkpoint of whole-parameter shards (optimizer_params='whole') holding "
                "DTensor parameters: use optimizer_params='flat' or 'pieces' with TP"
            )
        numels = [_numel_at(s, slot, coordinate) for s in flat.slots]
        offsets = [sum(numels[:j]) for j in range(len(numels))]
        bounds = even_bounds(sum(numels), flat.world_size)
        part = slot.layout.part_at(coordinate)
    numel = slot.numel if part is None else part.numel
    shape = tuple(slot.shape) if part is None else part.shape
    for q in range(flat.world_size):
        lo = max(bounds[q], offsets[i]) - offsets[i]
        hi = min(bounds[q + 1], offsets[i] + numel) - offsets[i]
        at = offsets[i] + lo - bounds[q]  # where element lo sits in rank q's shard
        for box_offsets, sizes, index in boxes(shape, lo, hi):
            pieces = (
                [(box_offsets, sizes, index)]
                if part is None
                else part.to_global(box_offsets, sizes)
            )
            for where, size, local_index in pieces:
                yield q, where, size, at + local_index - lo, part is None or part.mine


def _numel_at(s: ParamSlot, slot: ParamSlot, coordinate: tuple[int, ...]) -> int:
    """Slot ``s``'s local numel on the ranks at ``coordinate`` of ``slot``'s mesh."""
    if s.layout is None:
        return s.numel
    if s.layout.mesh != slot.layout.mesh:
        raise NotImplementedError(
            f"a checkpoint of a unit whose DTensor parameters lie on different meshes "
            f"('{s.name}', '{slot.name}'): wrap the parameters of each mesh in their own unit"
        )
    return s.layout.part_at(coordinate).numel


def _rank_at(slot: ParamSlot, coordinate: tuple[int, ...]) -> int:
    """The global rank at ``coordinate`` of the slot's mesh."""
    return int(slot.layout.mesh.mesh[coordinate].item())


def _whole(flat: FlatParam, i: int, local: Local, dtype: torch.dtype) -> torch.Tensor:
    """A small slot (0-dim or empty) in full on every rank: broadcast from its owner."""
    slot = flat.slots[i]
    value = torch.zeros(slot.numel, dtype=dtype, device=flat.shard.device)
    if slot.numel:
        owner = flat.owner(slot.offset)
        if owner == flat.rank:
            value.copy_(local(slot.offset - flat.rank_range()[0], slot.numel))
        collectives.broadcast(value, flat.group, src_rank=owner, tag=flat.tag)
    return value.view(slot.shape)


def _is_small(slot: ParamSlot) -> bool:
    """A 0-dim or empty parameter: saved whole (a plain tensor), not as boxes."""
    small = len(slot.full_shape) == 0 or slot.full_shape.numel() == 0
    if small and slot.layout is not None:
        raise NotImplementedError(
            f"a checkpoint of the 0-dim or empty DTensor parameter '{slot.name}': keep it a "
            "plain tensor (leave it out of the TP plan)"
        )
    return small


def _save_value(
    flat: FlatParam, i: int, local: Local, dtype: torch.dtype, device: torch.device | None = None
) -> Any:
    if _is_small(flat.slots[i]):
        whole = _whole(flat, i, local, dtype)
        return whole if device is None else whole.to(device)
    return _sharded_tensor(flat, i, local, dtype, device)


def _load_dest(
    flat: FlatParam, i: int, local: Local, dtype: torch.dtype, after: list[Callable]
) -> Any:
    """Where DCP should read slot ``i`` so that this rank's part lands in ``local``."""
    slot = flat.slots[i]
    if not _is_small(slot):
        return _sharded_tensor(flat, i, local, dtype)
    whole = torch.zeros(slot.shape, dtype=dtype, device=flat.shard.device)

    def write() -> None:
        for j, lo, hi, at in flat.pieces():
            if j == i:
                local(at, hi - lo).copy_(whole.reshape(-1)[lo:hi])

    after.append(write)
    return whole


# -- what goes into a checkpoint ----------------------------------------------------


def _model_items(
    model: nn.Module, prefix: str = "model.", copy: bool = False, to: torch.device | None = None
) -> dict[str, Any]:
    """Every key of the model's state dict under ``prefix``: ShardedTensors of this rank's
    boxes (0-dim parameters whole), buffers as they are. The values view the shards
    themselves (what ``save_checkpoint`` writes: no copy); with ``copy`` they view one copy
    of each shard, made on ``to`` (default: the shard's device), and buffers are copied too
    (the sharded state dict of ``FSDPModule.state_dict_type``: edits of either side stay
    apart). Collective only for 0-dim parameters (broadcast from their owner)."""
    slots, tensors = state_dict_layout(model)
    sources: dict[int, torch.Tensor] = {}
    items: dict[str, Any] = {}
    for k, (flat, i) in slots.items():
        if id(flat) not in sources:
            shard = flat.shard.detach()
            sources[id(flat)] = shard.to(to or shard.device, copy=True) if copy else shard
        src = sources[id(flat)]
        items[prefix + k] = _save_value(flat, i, _of(src), flat.shard.dtype, src.device)
    for key, (tensor, dtype) in tensors.items():
        value = tensor.detach()
        items[prefix + key] = value.to(to or value.device, dtype, copy=copy)
    return items


def _optim_items(model: nn.Module, optimizer: torch.optim.Optimizer, prefix: str) -> dict[str, Any]:
    entries = _optim.optimizer_entries(model, optimizer)
    ex = _optim.exchange(model, optimizer, entries)
    items: dict[str, Any] = {
        f"{prefix}.param_groups.{gi}.{key}": value
        for gi, group in enumerate(ex.groups)
        for key, value in group.items()
    }
    names = param_names(model)
    for flat in flat_params(model):
        for key, dtype in _optim.sharded_keys(flat, names, ex.kinds).items():
            local = functools.partial(_optim.shard_view, _optim.local_state(flat, key, entries))
            for i, slot in enumerate(flat.slots):
                kind = ex.kinds.get(names[id(slot)], {}).get(key)
                if kind is not None and kind[0] == "sharded":
                    item = f"{prefix}.state.{names[id(slot)]}.{key}"
                    items[item] = _save_value(flat, i, local, dtype)
    for name, kinds in ex.kinds.items():
        for key, kind in kinds.items():
            if kind[0] == "value":
                items[f"{prefix}.state.{name}.{key}"] = kind[1]
    return items


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write a sharded DCP checkpoint of ``model`` (and ``optimizer``: one, or a list such
    as ``[Muon, AdamW]``) to the directory ``path``, atomically. Call on every rank; each
    writes only its own shards.

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
        optimizers = _as_list(optimizer)
        for k, opt in enumerate(optimizers):
            items.update(_optim_items(model, opt, _prefix(k)))
        items[f"extra.rank{collectives.rank(group)}"] = dict(extra or {})
        shards = collectives.world_size(model.process_group)
        items[MARKER] = {"format": FORMAT, "shards": shards, "optimizers": len(optimizers)}
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


def _as_list(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]


def _prefix(k: int) -> str:
    """Keys of the k-th optimizer: ``optim.*``, then ``optim1.*``, ``optim2.*``..."""
    return "optim" if k == 0 else f"optim{k}"


def _checkpoint_group(model: nn.Module) -> collectives.ProcessGroup:
    """The ranks that save and load together: the shard group or, with hybrid sharding or
    DTensor parameters (tensor parallel on other mesh dims), the world (each box is then
    written once, by one of the ranks holding it)."""
    replicate = getattr(model, "replicate_group", None)
    world = collectives.resolve_group(None)
    if any(slot.layout is not None for flat in flat_params(model) for slot in flat.slots):
        return world
    if replicate is None:
        return model.process_group
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
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Restore ``model`` (and ``optimizer``) in place from a DCP checkpoint written at any
    world size, by ``save_checkpoint`` or by another program (PyTorch FSDP2's
    ``dcp.save({"model": ..., "optim": ...})``, torchtitan, a weights-only export: see the
    module's docstring); return the ``extra`` dict this rank saved (rank 0's when the
    checkpoint was written by fewer ranks; ``{}`` for another program's). Call on every
    rank.

    The checkpoint must hold exactly the model's keys and shapes, and the optimizer's
    parameter groups (see ``fsdp_lite.addons.optim_state``); otherwise, or if the directory is
    incomplete, ``CheckpointError`` is raised on every rank before anything is loaded.
    ``strict=False`` loads the model keys both sides have (warning with the ones skipped;
    shapes must still agree) and leaves the rest as it is. ``extra`` is unpickled: load
    only checkpoints you trust.
    """
    check_idle(model, "load a checkpoint")
    path = _existing_checkpoint(os.fspath(path))
    metadata = _read_metadata(path)
    keys = metadata.state_dict_metadata
    ours = MARKER in keys  # written by save_checkpoint
    group = _checkpoint_group(model)
    rank = collectives.rank(group)
    extra_key = f"extra.rank{rank}" if f"extra.rank{rank}" in keys else "extra.rank0"
    after: list[Callable] = []
    with _quiet_sharded_tensor():
        dest, apply_model = _model_dest(model, keys, after, _model_prefix(keys, ours), strict)
        applies = []
        for k, opt in enumerate(_as_list(optimizer)):
            prefix = _optim_prefix(keys, ours, k)
            if prefix is None:
                raise CheckpointError(
                    f"{path} holds no optimizer state for optimizer {k} (saved with fewer "
                    "optimizers, or without optimizer=)"
                )
            optim_dest, apply_optim = _optim_dest(model, opt, keys, after, prefix)
            dest.update(optim_dest)
            applies.append(apply_optim)
        if extra_key in keys:
            dest[extra_key] = None
        dcp.load(
            dest,
            storage_reader=dcp.FileSystemReader(path),
            planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            process_group=group,
        )
    for fn in after:
        fn()
    for apply_optim in applies:  # first: each checks its param groups before loading
        apply_optim(dest)
    apply_model()
    return dest.get(extra_key) or {}


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
    for info in (metadata.storage_data or {}).values():
        file = os.path.join(path, info.relative_path)
        if not os.path.exists(file) or os.path.getsize(file) < info.offset + info.length:
            raise CheckpointError(f"{path} is incomplete: {info.relative_path} is missing or short")
    return metadata


def _model_prefix(keys: dict, ours: bool) -> str:
    """``model.`` (fsdp_lite, FSDP2's ``{"model": ...}``) or none (a weights-only export,
    torchtitan's top-level model keys)."""
    if ours or any(k.startswith("model.") for k in keys):
        return "model."
    return ""


def _optim_prefix(keys: dict, ours: bool, k: int) -> str | None:
    """Where the k-th optimizer's keys are (None: nowhere)."""
    candidates = [_prefix(k)] if ours or k else ["optim", "optimizer"]
    for prefix in candidates:
        if any(key.startswith(f"{prefix}.param_groups") for key in keys):
            return prefix
    return None


def _model_dest(model: nn.Module, keys: dict, after: list[Callable], prefix: str, strict: bool):
    shapes = {
        k.removeprefix(prefix): tuple(md.size)
        for k, md in keys.items()
        if k.startswith(prefix)
        and isinstance(md, TensorStorageMetadata)
        and (prefix or not k.startswith(_NOT_MODEL))
    }
    hint = "the checkpoint is of another model (or another version of it)"
    if not strict:
        hint += "; strict=False loads the keys both have"
    try:
        result = validate_keys(expected_shapes(model), shapes, strict, "load_checkpoint", hint)
    except RuntimeError as exc:
        raise CheckpointError(str(exc)) from None
    if result.missing_keys or result.unexpected_keys:
        warnings.warn(
            f"load_checkpoint(strict=False): left as they were: {result.missing_keys}; "
            f"skipped: {result.unexpected_keys}",
            stacklevel=3,
        )
    return _dest_for(model, shapes, after, prefix)


def _dest_for(model: nn.Module, shapes: dict[str, Any], after: list[Callable], prefix: str):
    """Where a load should put each model key in ``shapes`` (under ``prefix``): values that
    view a scratch copy of the shards (``after`` gets writers for whole 0-dim values), and
    ``apply()``, which copies the scratch into the shards and the buffers into place."""
    slots, tensors = state_dict_layout(model)
    # Started from the current values: keys the checkpoint lacks (strict=False) keep them.
    scratch = {id(f): f.shard.detach().clone() for f, _ in slots.values()}
    dest: dict[str, Any] = {}
    for key, (flat, i) in slots.items():
        if key in shapes:
            local = _of(scratch[id(flat)])
            dest[prefix + key] = _load_dest(flat, i, local, flat.shard.dtype, after)
    for key, (tensor, dtype) in tensors.items():
        if key in shapes:
            dest[prefix + key] = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)

    @torch.no_grad()
    def apply() -> None:
        for unit in units_of(model):
            unit.reshard()  # full params kept by reshard_after_forward=False would go stale
        for flat, _ in slots.values():
            flat.home.before_host_write(flat.shard)
            flat.shard.copy_(scratch[id(flat)])
        for key, (tensor, _) in tensors.items():
            if key in shapes:
                tensor.copy_(dest[prefix + key])

    return dest, apply


def _optim_dest(
    model: nn.Module, optimizer: torch.optim.Optimizer, keys: dict, after: list, prefix: str
):
    entries = _optim.optimizer_entries(model, optimizer)
    kinds: dict[str, dict[str, tuple]] = {}
    for key, md in keys.items():
        if key.startswith(f"{prefix}.state."):
            name, state_key = key.removeprefix(f"{prefix}.state.").rsplit(".", 1)
            kind = ("tensor", tuple(md.size), md.properties.dtype, None)
            is_tensor = isinstance(md, TensorStorageMetadata)
            kinds.setdefault(name, {})[state_key] = kind if is_tensor else ("value", None)
    held = _optim.held_names(model, optimizer, entries)
    try:
        _optim.check_known(held, kinds)
        _optim.check_saved_shapes(model, kinds)
        layouts = [_optim.entry_state_keys(e, kinds) for e in entries]
    except RuntimeError as exc:
        raise CheckpointError(str(exc)) from None
    group_keys = [k for k in keys if k.startswith(f"{prefix}.param_groups")]
    dest: dict[str, Any] = {k: _object_dest(keys[k]) for k in group_keys}
    per_entry: list[dict[str, Any]] = []
    for e, layout in zip(entries, layouts, strict=True):
        state: dict[str, Any] = {}
        for key, (sharded, dtype, _) in layout.items():
            if sharded:
                state[key] = torch.zeros(e.param.shape, dtype=dtype, device=e.param.device)
            else:
                item = f"{prefix}.state.{e.names[0]}.{key}"
                md = keys[item]
                is_tensor = isinstance(md, TensorStorageMetadata)
                value = torch.empty(md.size, dtype=md.properties.dtype) if is_tensor else None
                dest[item] = value
                state[key] = item  # filled in after the load
        per_entry.append(state)
    names = param_names(model)
    for flat in flat_params(model):
        for key, (dtype, present) in _optim.saved_sharded_keys(flat, names, kinds).items():
            mine = [
                (e, state)
                for e, layout, state in zip(entries, layouts, per_entry, strict=True)
                if e.flat is flat and layout.get(key, (False,))[0]
            ]
            segments = [(e.at, state[key].view(-1)) for e, state in mine]
            local = functools.partial(_optim.shard_view, segments)
            held_here = {n for e, _ in mine for n in e.names}
            for i in present:
                name = names[id(flat.slots[i])]
                if name in held_here:
                    dest[f"{prefix}.state.{name}.{key}"] = _load_dest(flat, i, local, dtype, after)

    def apply(loaded: dict[str, Any]) -> None:
        for layout, state in zip(layouts, per_entry, strict=True):
            for key, (sharded, _, _) in layout.items():
                if not sharded:
                    state[key] = loaded[state[key]]
        try:
            groups = _saved_groups(prefix, {k: loaded[k] for k in group_keys}, held)
            _optim.check_groups(held, groups)
            _optim.apply_shard_state(optimizer, entries, per_entry, groups)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None

    return dest, apply


def _object_dest(md: Any) -> Any:
    """Where DCP reads a saved non-sharded value: a tensor of its size, or None (a pickled
    object, set by the planner)."""
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    return None


def _saved_groups(prefix: str, loaded: dict[str, Any], held: list[set[str]]) -> list[dict]:
    """The checkpoint's param groups as ``[{hyperparameters..., "params": [names]}]``, from
    one object (format 1), from ``<prefix>.param_groups.<i>.<hp>`` keys (fsdp_lite, FSDP2),
    or from ``<prefix>.param_groups.<name>.<hp>`` keys (``flatten_optimizer_state_dict``:
    per parameter, grouped here as this optimizer groups them)."""
    base = f"{prefix}.param_groups"
    if base in loaded:
        return loaded[base]
    by_index: dict[int, dict[str, Any]] = {}
    by_name: dict[str, dict[str, Any]] = {}
    for key, value in loaded.items():
        rest = key.removeprefix(base + ".")
        head, _, hp = rest.partition(".")
        if head.isdigit():
            by_index.setdefault(int(head), {})[hp] = value
        else:
            name, hp = rest.rsplit(".", 1)
            by_name.setdefault(name, {})[hp] = value
    if by_index:
        return [by_index[i] for i in sorted(by_index)]
    groups = []
    for gi, names in enumerate(held):
        hps = [by_name.get(n) for n in sorted(names)]
        if any(h is None for h in hps) or any(h != hps[0] for h in hps):
            raise ValueError(
                f"the checkpoint's hyperparameters for the parameters of param group {gi} "
                "are missing or differ between them: build the optimizer's groups as the "
                "checkpoint's were"
            )
        groups.append({**(hps[0] or {}), "params": sorted(names)})
    return groups


# -- the sharded state dict (FSDPModule.state_dict_type) ---------------------------------


def sharded_state_dict(model: nn.Module, offload_to_cpu: bool = False) -> dict[str, Any]:
    """``model.state_dict()`` under ``SHARDED_STATE_DICT``: the model part of a checkpoint
    (``_model_items``) keyed as the unwrapped model's state dict, for
    ``torch.distributed.checkpoint``: ``dcp.save(sd, ...)``, or ``dcp.load(sd, ...)`` and
    then ``model.load_state_dict(sd)``. Flattened parameters are ShardedTensors of this
    rank's boxes, 0-dim ones and buffers whole; the values are copies (on CPU with
    ``offload_to_cpu``), so ``dcp.load`` into them changes the model only at
    ``load_state_dict``. Collective: call on every rank."""
    check_idle(model, "produce a sharded state dict")
    with _quiet_sharded_tensor():
        return _model_items(
            model, prefix="", copy=True, to=torch.device("cpu") if offload_to_cpu else None
        )


@torch.no_grad()
def load_sharded_state_dict(
    model: nn.Module, sd: dict[str, Any], strict: bool = True
) -> IncompatibleKeys:
    """``model.load_state_dict(sd)`` under ``SHARDED_STATE_DICT``: write a dict shaped as
    ``sharded_state_dict`` returns (typically filled by ``dcp.load``) into the shards,
    through what ``load_checkpoint`` loads the model with (``_dest_for``). Each
    ShardedTensor must hold this rank's boxes, as one taken from a model wrapped the same
    way does. Every rank raises alike on a mismatch, before anything is loaded."""
    check_idle(model, "load a state dict")
    if not isinstance(sd, dict):
        raise TypeError(f"load_state_dict needs a dict, got {type(sd).__name__}")
    with _quiet_sharded_tensor():
        shapes = {
            k: tuple(v.size()) for k, v in sd.items() if isinstance(v, ShardedTensor | torch.Tensor)
        }
    result = validate_keys(
        expected_shapes(model), shapes, strict, "load_state_dict (SHARDED_STATE_DICT)"
    )
    after: list[Callable] = []
    error = None
    with _quiet_sharded_tensor():
        dest, apply = _dest_for(model, shapes, after, prefix="")
        try:
            for key, target in dest.items():
                _copy_sharded(key, target, sd[key])
        except (TypeError, ValueError, RuntimeError) as exc:
            error = str(exc)
    errors = collectives.all_gather_object(error, model.process_group)
    if any(e is not None for e in errors):  # every rank raises: none loads alone
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        same = len(set(errors)) == 1
        raise ValueError(
            "load_state_dict (SHARDED_STATE_DICT): nothing was loaded: "
            + (errors[0] if same else "; ".join(failed))
        )
    for fn in after:
        fn()
    apply()
    return result


def _copy_sharded(key: str, target: Any, value: Any) -> None:
    """Copy ``value`` (what the user loaded) into ``target`` (a ShardedTensor viewing the
    scratch of ``_dest_for``, or a whole tensor): box by box, matched by offsets."""
    if not isinstance(target, ShardedTensor):
        if isinstance(value, ShardedTensor):
            raise TypeError(f"'{key}' is a ShardedTensor here but whole in this model")
        target.copy_(value)
        return
    if not isinstance(value, ShardedTensor):
        raise TypeError(
            f"'{key}' is a {type(value).__name__}, not a ShardedTensor: load a full state dict "
            "under FULL_STATE_DICT instead, or take the dict from model.state_dict() under "
            "SHARDED_STATE_DICT and dcp.load into it"
        )
    theirs = {
        (tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)): s.tensor
        for s in value.local_shards()
    }
    for shard in target.local_shards():
        box = (tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes))
        if box not in theirs:
            raise ValueError(
                f"'{key}': the ShardedTensor lacks this rank's box {box} (it was sharded "
                "another way: another world size, optimizer_params or model). Take the "
                "dict from this model's state_dict() under SHARDED_STATE_DICT and "
                "dcp.load into it: DCP reshards on load"
            )
        shard.tensor.copy_(theirs[box])
