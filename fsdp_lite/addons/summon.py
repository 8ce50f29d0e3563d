"""summon_full_params: the original, full fp32 parameters, as real ``nn.Parameter``s.

Inside the context every original parameter location holds an ``nn.Parameter`` viewing
one fp32 copy of its flat param, gathered from the shards, so ``named_parameters()``,
EMA updates, custom init and inspection see the unwrapped model. On exit, with
``writeback``, each rank copies its own slice of the (possibly edited) values back
into its shard (no communication); the full copies are then dropped, so memory returns
to the sharded footprint once the caller holds no references to them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from fsdp_lite.addons.state_dict import is_rank0, write_shard
from fsdp_lite.core import collectives
from fsdp_lite.core.dtensors import local_tensor
from fsdp_lite.core.flat_param import FlatParam
from fsdp_lite.core.state import TrainingState, check_state
from fsdp_lite.core.tree import unit_of

if TYPE_CHECKING:
    from fsdp_lite.core.unit import Unit

# What one location held before the summon (the storage-less view of the full buffer).
_Saved = list[tuple[nn.Module, str, object]]


@contextlib.contextmanager
def summon_full_params(
    root: nn.Module,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    recurse: bool = True,
    with_grads: bool = False,
) -> Iterator[None]:
    """See ``FSDPModule.summon_full_params``. Collective on entry (one all-gather per flat
    param, and with ``with_grads`` one more per flat param with gradients); exit does not
    communicate."""
    if rank0_only and writeback:
        raise ValueError(
            "summon_full_params(rank0_only=True, writeback=True) is not supported: only "
            "rank 0 would see the full parameters, so edits could not reach the other "
            "ranks' shards. Pass writeback=False, or rank0_only=False"
        )
    # The wrappers (their shards are registered on them) and their units; a forward
    # inside is refused by the units' own pre-forward (state SUMMON_FULL_PARAMS).
    wrappers = [m for m in root.modules() if unit_of(m) is not None] if recurse else [root]
    units: list[Unit] = [unit_of(m) for m in wrappers]
    for unit in units:
        check_state(unit.name, unit.state, TrainingState.IDLE, doing="summon_full_params")
    keep = not rank0_only or is_rank0(root)
    flats = [flat for unit in units for flat in unit.flat_params]
    saved: list[_Saved] = []
    for unit in units:
        # Full parameters kept from a forward (the root's, reshard_after_forward=False) are
        # freed first, as the root's next forward would: a backward of that forward still
        # to come gathers them again, from the shards as they are after the summon.
        unit.reshard()
        for flat in unit.flat_params:
            flat.adopt_orig_writes()
        unit.state = TrainingState.SUMMON_FULL_PARAMS
    try:
        grads = _grads_to_gather(flats) if with_grads else [None] * len(flats)
        for flat, grad in zip(flats, grads, strict=True):
            saved.append(_install_full(flat, keep, offload_to_cpu, grad))
        _restore_param_order(saved)
        if keep:  # hide the shards: inside, parameters() yields the originals only
            saved.append(_hide_shards(wrappers))
        yield
        if writeback:
            for flat in flats:
                _write_back(flat)
    finally:
        for entries in saved:
            _uninstall(entries)
        for unit in units:
            unit.state = TrainingState.IDLE


def _grads_to_gather(flats: list[FlatParam]) -> list[torch.Tensor | None]:
    """Per flat param, this rank's shard-shaped gradient to gather (zeros where this rank
    has none), or None where no rank has one: every rank must gather the same ones (one
    small all-reduce per group decides)."""
    local = [flat.grad_as_shard() for flat in flats]
    has = torch.tensor([g is not None for g in local], dtype=torch.float32)
    for flat in {id(f.group): f for f in flats}.values():  # one per group, under its tag
        collectives.all_reduce(has, flat.group, op="max", kind="summon_grads", tag=flat.tag)
    return [
        None if not h else (g if g is not None else torch.zeros_like(flat.shard.detach()))
        for flat, g, h in zip(flats, local, has.tolist(), strict=True)
    ]


@torch.no_grad()
def _install_full(
    flat: FlatParam, keep: bool, offload_to_cpu: bool, grad: torch.Tensor | None
) -> _Saved:
    """Gather ``flat`` in fp32 (and ``grad``, this rank's shard-shaped gradient, into each
    parameter's ``.grad``) and register one ``nn.Parameter`` per slot at every location."""
    full = flat.gather_fp32()  # (numel,)
    full_grad = None if grad is None else flat.gather_fp32(grad)
    if not keep:
        return []
    if offload_to_cpu:
        full = full.to("cpu", copy=True)
        full_grad = None if full_grad is None else full_grad.to("cpu", copy=True)
    saved: _Saved = []
    for slot in flat.slots:
        # A DTensor parameter is summoned as a DTensor over its own local tensor
        value = slot.as_module_sees(full[slot.offset : slot.offset + slot.numel])
        param = nn.Parameter(value, requires_grad=flat.requires_grad)
        if full_grad is not None:
            param.grad = slot.as_module_sees(full_grad[slot.offset : slot.offset + slot.numel])
        for module, attr in slot.locations:
            saved.append((module, attr, module.__dict__.pop(attr, None)))
            module._parameters[attr] = param  # a tie: one Parameter at every location
    return saved


def _hide_shards(wrappers: list[nn.Module]) -> _Saved:
    hidden: _Saved = []
    for wrapper in wrappers:
        shards = {id(p) for flat in unit_of(wrapper).flat_params for p in flat.optimizer_params()}
        for name, param in list(wrapper._parameters.items()):
            if id(param) in shards:
                hidden.append((wrapper, name, wrapper._parameters.pop(name)))
    return hidden


def _restore_param_order(saved: list[_Saved]) -> None:
    """Put each touched module's parameters back in their original registration order."""
    modules = {id(m): m for entries in saved for m, _, _ in entries}
    for module in modules.values():
        params = module._parameters
        for name in module.__dict__.get("_fsdp_lite_param_order", []):
            if name in params:
                params[name] = params.pop(name)


@torch.no_grad()
def _write_back(flat: FlatParam) -> None:
    """Copy this rank's slice of every slot's current value (first location) into the shard."""
    values = {}
    for i, slot in enumerate(flat.slots):
        module, attr = slot.locations[0]
        value = local_tensor(getattr(module, attr))
        if tuple(value.shape) != tuple(slot.shape):
            raise RuntimeError(
                f"summon_full_params(writeback=True): parameter '{slot.name}' has shape "
                f"{tuple(value.shape)} at exit but {tuple(slot.shape)} was summoned; edit "
                "parameters in place (shapes cannot change under fsdp_lite)"
            )
        values[i] = value.detach()
    write_shard(flat.shard, flat, values)


def _uninstall(saved: _Saved) -> None:
    for module, attr, previous in saved:
        module._parameters.pop(attr, None)
        if isinstance(previous, nn.Parameter):  # a hidden shard
            module._parameters[attr] = previous
        elif previous is not None:
            module.__dict__[attr] = previous
