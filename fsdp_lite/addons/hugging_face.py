"""Hugging Face-format checkpoints of wrapped models: ``save_pretrained`` and
``load_pretrained``.

[Note: streamed HF checkpoints]
``save_pretrained`` writes what the unwrapped model's own ``save_pretrained`` writes
(``config.json``, ``generation_config.json``, safetensors weights under the unwrapped
keys, one copy of each tied weight, persistent buffers only), without ever holding the
full model: every rank computes the same plan of output files up front (key order = the
order the values become available: flat params in ``flat_params`` order, then buffers),
then gathers one flat param at a time. The writing rank copies that flat param's slots to
CPU and writes a file as soon as its last tensor arrived, so it holds at most one file of
CPU tensors plus one gathered flat param; the others hold one gathered flat param.

Files are written into a staging directory inside ``save_directory`` and moved into place
(one ``os.replace`` each, weights first, the index and config last) only once all are
complete: a crash while writing leaves the previous checkpoint as it was. Other files in
the directory (a tokenizer) are kept, weight files of a previous save that the new one
does not name are removed, as HF does.

``load_pretrained`` needs no communication: each rank opens the files itself and reads,
with ``safe_open(...).get_slice``, only the boxes (see ``state_dict.boxes``) of each
parameter that its own shard holds.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_lite.addons.checkpoints import CheckpointError
from fsdp_lite.addons.state_dict import (
    IncompatibleKeys,
    boxes,
    check_idle,
    expected_shapes,
    flat_params,
    is_rank0,
    state_dict_layout,
    validate_keys,
)
from fsdp_lite.core import collectives
from fsdp_lite.core.flat_param import FlatParam
from fsdp_lite.core.tree import clean_named_modules

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
STAGING = ".fsdp_lite_staging"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.torch
    except ImportError as exc:
        raise ImportError(
            "fsdp_lite.save_pretrained / load_pretrained need safetensors: pip install safetensors"
        ) from exc
    return safetensors


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like ``"5GB"`` (10^9) or ``"200MiB"`` (2^20)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", str(size).upper())
    if match is None:
        raise ValueError(
            f"max_shard_size: cannot read {size!r}; use an int or e.g. '5GB', '500MiB'"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


# -- what to write, and where -------------------------------------------------------


@dataclass
class _Entry:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: tuple[FlatParam, int] | torch.Tensor  # (flat param, slot index) or the tensor
    is_param: bool

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize


def _tied_patterns(model: nn.Module) -> list[str]:
    """The tied-weight keys the HF model declares (``_tied_weights_keys``), as regexes."""
    out: list[str] = []
    for prefix, module in clean_named_modules(model):
        for key in getattr(module, "_tied_weights_keys", None) or ():
            out.append(f"{prefix}.{key}" if prefix else key)
    return out


def _keep_one(names: list[str], patterns: list[str]) -> str:
    """HF's choice among keys sharing one tensor (``remove_tied_weights_from_state_dict``):
    in sorted order, names matching a tied-weight pattern are dropped while more than one
    remains; of the rest, the first in module order is written."""
    dropped: set[str] = set()
    for name in sorted(names):
        if len(dropped) < len(names) - 1 and any(re.search(p, name) for p in patterns):
            dropped.add(name)
    return next(n for n in names if n not in dropped)


def _entries(model: nn.Module, dtype: torch.dtype | None) -> list[_Entry]:
    """What ``save_pretrained`` writes, in the order the values become available."""
    slots, tensors = state_dict_layout(model)
    ignored = set(getattr(model.module, "_keys_to_ignore_on_save", None) or ())
    names: dict[tuple[int, int], list[str]] = {}  # (id(flat), slot) -> every key of it
    for key, (flat, i) in slots.items():
        names.setdefault((id(flat), i), []).append(key)
    patterns = _tied_patterns(model)
    out: list[_Entry] = []
    for flat in flat_params(model):
        for i, slot in enumerate(flat.slots):
            keys = [k for k in names.get((id(flat), i), []) if k not in ignored]
            if keys:
                key = _keep_one(keys, patterns)
                shape = tuple(slot.full_shape)
                out.append(_Entry(key, shape, dtype or torch.float32, (flat, i), True))
    for key, (tensor, saved) in tensors.items():
        if key not in ignored:
            is_param = isinstance(tensor, nn.Parameter)
            cast = dtype if dtype is not None and is_param and saved.is_floating_point else saved
            out.append(_Entry(key, tuple(tensor.shape), cast, tensor, is_param))
    return out


def _split(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    """Consecutive entries into files of at most ``max_bytes`` (a larger tensor gets a file
    of its own), as ``huggingface_hub.split_torch_state_dict_into_shards`` does."""
    files: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


# -- saving ---------------------------------------------------------------------------


class _Writer:
    """The writing rank's side of ``save_pretrained``: buffers one file's CPU tensors,
    writes each file into the staging directory once complete, publishes at the end.

    The first error is kept and every later call does nothing, so this rank still joins
    every gather its peers issue; the error is raised on every rank at the end.
    """

    def __init__(self, directory: str, files: list[list[_Entry]]) -> None:
        self.directory = directory
        self.stage = os.path.join(directory, STAGING)
        self.names = _file_names(len(files))
        self.file_of = {e.key: n for n, entries in enumerate(files) for e in entries}
        self.left = [len(entries) for entries in files]
        self.buffer: dict[str, torch.Tensor] = {}
        self.error: str | None = None

    def run(self, fn: Any, *args: Any) -> None:
        if self.error is None:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - reported on every rank, see save_pretrained
                self.error = f"{type(exc).__name__}: {exc}"
                self.buffer = {}

    def begin(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        shutil.rmtree(self.stage, ignore_errors=True)  # left by an interrupted save
        os.makedirs(self.stage)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        self.buffer[key] = tensor
        n = self.file_of[key]
        self.left[n] -= 1
        if self.left[n] == 0:  # entries arrive in file order: the buffer is exactly file n
            path = os.path.join(self.stage, self.names[n])
            _safetensors().torch.save_file(self.buffer, path, metadata={"format": "pt"})
            self.buffer = {}

    def finish(self, model: nn.Module, files: list[list[_Entry]], dtype: torch.dtype) -> None:
        inner = model.module
        config = _saved_config(inner, dtype)
        config.save_pretrained(self.stage)
        written = list(self.names)
        generation = getattr(inner, "generation_config", None)
        if generation is not None and (not hasattr(inner, "can_generate") or inner.can_generate()):
            generation.save_pretrained(self.stage)
        if len(files) > 1:
            with open(os.path.join(self.stage, INDEX_NAME), "w", encoding="utf-8") as f:
                f.write(json.dumps(_index(files, self.names), indent=2, sort_keys=True) + "\n")
            written.append(INDEX_NAME)
        last = sorted(set(os.listdir(self.stage)) - set(written))  # configs: last
        for name in written + last:
            os.replace(os.path.join(self.stage, name), os.path.join(self.directory, name))
        for name in os.listdir(self.directory):  # weights of an earlier save not named now
            stale = name == INDEX_NAME or name == WEIGHTS_NAME or _SHARD_FILE.fullmatch(name)
            if stale and name not in written:
                os.remove(os.path.join(self.directory, name))
        os.rmdir(self.stage)


def _saved_config(inner: nn.Module, dtype: torch.dtype) -> Any:
    """A copy of the HF config as HF's ``save_pretrained`` writes it (dtype, architectures)."""
    config = copy.deepcopy(inner.config)
    config.dtype = str(dtype).removeprefix("torch.")
    config.architectures = [type(inner).__name__]
    return config


def _index(files: list[list[_Entry]], names: list[str]) -> dict[str, Any]:
    entries = [e for f in files for e in f]
    return {
        "metadata": {
            "total_parameters": sum(e.nbytes // e.dtype.itemsize for e in entries if e.is_param),
            "total_size": sum(e.nbytes for e in entries),
        },
        "weight_map": {e.key: names[n] for n, f in enumerate(files) for e in f},
    }


def _check_supported(model: nn.Module, what: str) -> None:
    """Raise (on every rank alike, before any collective) unless a plain HF model is wrapped."""
    inner = model.module
    if getattr(inner, "peft_config", None) or getattr(inner, "_hf_peft_config_loaded", False):
        raise TypeError(
            f"{what}: the wrapped {type(inner).__name__} carries PEFT adapters, whose keys "
            "the base model class cannot load; merge them first (merge_and_unload()) and wrap "
            "the merged model, or use fsdp_lite.save_checkpoint / load_checkpoint"
        )
    if not hasattr(getattr(inner, "config", None), "save_pretrained"):
        raise TypeError(
            f"{what}: the wrapped {type(inner).__name__} has no Hugging Face config; wrap a "
            "transformers PreTrainedModel (or use fsdp_lite.save_checkpoint / load_checkpoint)"
        )


def save_pretrained(
    model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    is_main_process: bool | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write ``model`` as a Hugging Face checkpoint that the unwrapped class's
    ``from_pretrained(save_directory)`` loads: ``config.json`` (and
    ``generation_config.json``), safetensors weights under the unwrapped keys, one copy of
    each tied weight, persistent buffers; several files and ``model.safetensors.index.json``
    once ``max_shard_size`` (bytes, or e.g. ``"5GB"``) is exceeded.

    Collective: call on every rank. Parameters are gathered one flat param at a time and
    streamed to the writer (``is_main_process``, default: rank 0 of the model), which holds
    at most one output file of CPU tensors. Weights are fp32 (the master copy) unless
    ``dtype`` is given (e.g. ``torch.bfloat16``; buffers keep their own dtype). Files appear
    in ``save_directory`` only once all are written; other files there are kept. Any
    rank's failure is raised on every rank as ``CheckpointError``. Exactly one rank may
    write: pass ``is_main_process=True`` on one rank only, or leave it ``None``.
    """
    check_idle(model, "save_pretrained")
    _check_supported(model, "save_pretrained")
    _safetensors()
    files = _split(_entries(model, dtype), parse_size(max_shard_size))
    directory = os.fspath(save_directory)
    writes = is_rank0(model) if is_main_process is None else bool(is_main_process)
    writer = _Writer(directory, files) if writes else None
    if writer is not None:
        writer.run(writer.begin)
    _raise_any(model, writer, directory, "nothing was gathered")
    for flat, slots in _by_flat(files):
        full = flat.gather_fp32()  # (numel,): the only full copy of this flat param
        for i, e in slots:
            # A DTensor's whole value is gathered over its mesh on every rank (collective)
            piece = flat.slots[i].whole_value(full[flat.slots[i].offset :][: flat.slots[i].numel])
            if writer is not None:
                writer.run(writer.add, e.key, piece.to("cpu", e.dtype, copy=True))
        del full
    for e in (e for f in files for e in f if isinstance(e.source, torch.Tensor)):
        if writer is not None:
            writer.run(writer.add, e.key, e.source.detach().to("cpu", e.dtype, copy=True))
    if writer is not None:
        writer.run(writer.finish, model, files, dtype or torch.float32)
    _raise_any(
        model,
        writer,
        directory,
        f"files there are replaced only after all were written to {STAGING}",
    )


def _by_flat(files: list[list[_Entry]]) -> list[tuple[FlatParam, list[tuple[int, _Entry]]]]:
    """The entries of each flat param, grouped, in file order (= gather order)."""
    out: list[tuple[FlatParam, list[tuple[int, _Entry]]]] = []
    for e in (e for f in files for e in f if not isinstance(e.source, torch.Tensor)):
        flat, i = e.source
        if not out or out[-1][0] is not flat:
            out.append((flat, []))
        out[-1][1].append((i, e))
    return out


def _raise_any(model: nn.Module, writer: _Writer | None, directory: str, what: str) -> None:
    """Every rank raises if the writer failed (collective: the shard group, then, with
    hybrid sharding, the replicate group, so every rank of the model hears of it)."""
    error = None if writer is None else writer.error
    groups = [model.process_group, getattr(model, "replicate_group", None)]
    for group in (g for g in groups if g is not None):
        errors = collectives.all_gather_object(error, group)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise CheckpointError(f"save_pretrained failed writing {directory}: {error} ({what})")


# -- loading --------------------------------------------------------------------------


def load_pretrained(
    model: nn.Module, directory: str | os.PathLike, *, strict: bool = True
) -> IncompatibleKeys:
    """Load a Hugging Face safetensors checkpoint (``model.safetensors``, or shards named
    by ``model.safetensors.index.json``) into the wrapped ``model``, e.g. one built on the
    meta device and wrapped with ``param_init_fn=fsdp_lite.deferred_init.no_init``.

    Not collective: each rank reads only the parts of each parameter its own shard holds
    (``safe_open(...).get_slice``), never a whole parameter it does not own; buffers in
    the files are read whole. A tied weight stored once (``lm_head.weight`` tied to
    ``model.embed_tokens.weight``) loads under any of its keys. Keys and shapes are checked
    first: on a mismatch (missing or unexpected keys only with ``strict``) nothing is
    loaded and ``CheckpointError`` names every problem. Returns the missing and
    unexpected keys, as ``nn.Module.load_state_dict`` does. Non-persistent buffers (HF's
    rotary ``inv_freq``) are not in the files: they keep what wrapping gave them.
    """
    check_idle(model, "load_pretrained")
    safe_open = _safetensors().safe_open
    path = os.fspath(directory)
    where, shapes = _read_index(path, safe_open)
    slots, tensors = state_dict_layout(model)
    source, aliases = _sources(slots, shapes)
    seen = dict(shapes) | {k: shapes[v] for k, v in aliases.items()}
    hint = "the checkpoint is of another model (or another config of it)"
    try:
        result = validate_keys(expected_shapes(model), seen, strict, "load_pretrained", hint)
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    with contextlib.ExitStack() as stack, torch.no_grad():
        files = {
            f: stack.enter_context(safe_open(f, "pt", device="cpu")) for f in set(where.values())
        }
        for flat in flat_params(model):
            flat.reshard()  # full params kept by reshard_after_forward=False would go stale
            for i, lo, hi, at in flat.pieces():
                key = source.get((id(flat), i))
                if key is not None:
                    _read_piece(files[where[key]], key, flat, i, lo, hi, at)
        for key, (tensor, _) in tensors.items():
            if key in shapes:
                tensor.copy_(files[where[key]].get_tensor(key))
    return result


def _read_piece(file: Any, key: str, flat: FlatParam, i: int, lo: int, hi: int, at: int) -> None:
    """Elements ``[lo, hi)`` of slot ``i`` (of a DTensor's local tensor: boxes of its part
    of the global tensor) from ``file`` into this rank's shard."""
    flat.home.before_host_write(flat.shard)
    slot = flat.slots[i]
    shape = tuple(slot.shape)
    if not shape:  # 0-dim: the whole (one-element) tensor
        flat.shard[at : at + 1].copy_(file.get_tensor(key).reshape(1))
        return
    sliced = file.get_slice(key)
    part = None if slot.layout is None else slot.layout.my_part()
    for offsets, sizes, first in boxes(shape, lo, hi):
        found = [(offsets, sizes, first)] if part is None else part.to_global(offsets, sizes)
        for where, size, index in found:
            piece = sliced[tuple(slice(o, o + s) for o, s in zip(where, size, strict=True))]
            start = at + index - lo
            flat.shard[start : start + piece.numel()].copy_(piece.reshape(-1))


def _read_index(path: str, safe_open: Any) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """``key -> file`` and ``key -> shape`` of every tensor in the checkpoint at ``path``."""
    index, single = os.path.join(path, INDEX_NAME), os.path.join(path, WEIGHTS_NAME)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map: not a safetensors index")
        names = sorted(set(weight_map.values()))
    elif os.path.isfile(single):
        weight_map, names = None, [WEIGHTS_NAME]
    else:
        raise CheckpointError(
            f"{path} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}: not a Hugging Face "
            "safetensors checkpoint (pytorch_model.bin files are not read: convert them with "
            "the unwrapped model's from_pretrained + save_pretrained)"
        )
    where: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name in names:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(
                f"{path} is incomplete: {name}, named by {INDEX_NAME}, is missing"
            )
        with safe_open(file, "pt", device="cpu") as f:
            for key in f.keys():
                where[key] = file
                shapes[key] = tuple(f.get_slice(key).get_shape())
    lost = [k for k, name in (weight_map or {}).items() if where.get(k) != os.path.join(path, name)]
    if lost:
        raise CheckpointError(f"{path}: {INDEX_NAME} names keys its files do not hold: {lost[:5]}")
    return where, shapes


def _sources(
    slots: dict[str, tuple[FlatParam, int]], shapes: dict[str, Any]
) -> tuple[dict[tuple[int, int], str], dict[str, str]]:
    """Which key of the files to read each slot from (``(id(flat), slot) -> key``; any key
    of a tied slot will do), and ``model key -> file key`` for tied keys the files lack."""
    by_slot: dict[tuple[int, int], str] = {}
    for key, (flat, i) in slots.items():
        if key in shapes:
            by_slot.setdefault((id(flat), i), key)
    aliases = {
        key: by_slot[(id(flat), i)]
        for key, (flat, i) in slots.items()
        if key not in shapes and (id(flat), i) in by_slot
    }
    return by_slot, aliases


# -- tensor parallelism -------------------------------------------------------------


def hf_tp_plan(model: nn.Module) -> dict[str, Any]:
    """The model's own tensor-parallel plan (``config.base_model_tp_plan``, as the
    ``PreTrainedModel.tp_plan`` property gives it with the head's), as torch
    ``ParallelStyle`` objects for ``parallelize_module(model, world["tp"], plan)``, which takes
    its ``*`` wildcards. Apply it before wrapping::

        parallelize_module(model, world["tp"], fsdp_lite.hf_tp_plan(model))
        model = fsdp_lite.FSDPModule(model, mesh=world["dp"], auto_wrap_policy=...)

    A style this mapping does not know (a packed or expert-parallel one) raises, naming it.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel,
    }
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan (config.base_model_tp_plan); "
            "write one for parallelize_module (docs/tensor-parallel.md)"
        )
    unknown = sorted({style for style in plan.values() if style not in styles})
    if unknown:
        raise NotImplementedError(
            f"{type(model).__name__}'s tp_plan uses styles {unknown}, which hf_tp_plan does not "
            f"map to torch's (it maps {sorted(styles)}); write those entries yourself"
        )
    return {name: styles[style]() for name, style in plan.items()}
