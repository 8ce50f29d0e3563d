"""Full state dicts with the original module's keys (no wrapper prefixes)."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdp_lite import collectives
from fsdp_lite.state import TrainingState, check_state

if TYPE_CHECKING:
    from fsdp_lite.fsdp import FSDPModule

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


def clean_named_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Like ``named_modules`` of the unwrapped model: unit wrappers are stepped over."""
    from fsdp_lite.fsdp import FSDPModule

    while isinstance(module, FSDPModule):
        module = module.module
    yield prefix.rstrip("."), module
    for name, child in module._modules.items():
        if child is not None:
            yield from clean_named_modules(child, f"{prefix}{name}.")


def _param_names(module: nn.Module) -> list[str]:
    order = module.__dict__.get("_fsdp_lite_param_order")
    if order is None:
        return [n for n, p in module._parameters.items() if p is not None]
    return order


def _persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set:
            yield name, buf


def _check_idle(root: FSDPModule, doing: str) -> list[FSDPModule]:
    units = root._units()
    for unit in units:
        check_state(unit._unit_name, unit._state, TrainingState.IDLE, doing=doing)
    return units


def _expected_shapes(root: FSDPModule) -> dict[str, torch.Size]:
    """Every key of the full state dict and its shape, in the unwrapped module's order."""
    shapes: dict[tuple[int, str], torch.Size] = {}
    for unit in root._units():
        for flat in unit._flat_params:
            for slot in flat.slots:
                for module, attr in slot.locations:
                    shapes[(id(module), attr)] = slot.shape
    out: dict[str, torch.Size] = {}
    for prefix, module in clean_named_modules(root):
        pre = f"{prefix}." if prefix else ""
        for name in _param_names(module):
            p = module._parameters.get(name)
            shape = p.shape if p is not None else shapes.get((id(module), name))
            if shape is not None:
                out[pre + name] = shape
        for name, buf in _persistent_buffers(module):
            out[pre + name] = buf.shape
    return out


def _gathered_params(units: list[FSDPModule], grads: bool) -> dict[tuple[int, str], torch.Tensor]:
    """(id(module), attr) -> full CPU tensor of every flat-param slot (collective)."""
    values: dict[tuple[int, str], torch.Tensor] = {}
    for unit in units:
        for flat in unit._flat_params:
            if grads and not flat.requires_grad:
                continue
            source = flat.shard
            if grads:
                source = flat.shard.grad if flat.shard.grad is not None else torch.zeros_like(source)
            full = flat.gather_fp32(source).cpu()
            for slot in flat.slots:
                tensor = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
                for module, attr in slot.locations:
                    values[(id(module), attr)] = tensor
    return values


def full_state_dict(root: FSDPModule, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Gather every unit's parameters in fp32 (collective: call on every rank)."""
    units = _check_idle(root, "produce a state dict")
    values = _gathered_params(units, grads=False)
    sd: dict[str, torch.Tensor] = {}
    for prefix, module in clean_named_modules(root):
        pre = f"{prefix}." if prefix else ""
        for name in _param_names(module):
            p = module._parameters.get(name)
            value = p.detach().cpu().clone() if p is not None else values.get((id(module), name))
            if value is not None:
                sd[pre + name] = value
        dtypes = module.__dict__.get("_fsdp_lite_buffer_dtypes", {})
        for name, buf in _persistent_buffers(module):
            sd[pre + name] = buf.detach().to("cpu", dtypes.get(name, buf.dtype)).clone()
    if rank0_only and collectives.rank(root.process_group) != 0:
        return {}
    return sd


def full_grads(root: FSDPModule) -> dict[str, torch.Tensor]:
    """Gradients of every trainable parameter, unsharded, keyed like the state dict.

    Collective; for tests and debugging (it materializes every gradient on every rank).
    Parameters without a gradient this iteration read as zeros.
    """
    units = _check_idle(root, "gather gradients")
    values = _gathered_params(units, grads=True)
    out: dict[str, torch.Tensor] = {}
    for prefix, module in clean_named_modules(root):
        pre = f"{prefix}." if prefix else ""
        for name in _param_names(module):
            if (id(module), name) in values:
                out[pre + name] = values[(id(module), name)]
    return out


def _validate(root: FSDPModule, sd: dict[str, Any], strict: bool) -> IncompatibleKeys:
    expected = _expected_shapes(root)
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    misshapen = [
        f"{k}: checkpoint {tuple(sd[k].shape)}, model {tuple(shape)}"
        for k, shape in expected.items()
        if k in sd and tuple(sd[k].shape) != tuple(shape)
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
            "load_state_dict: the state dict does not match the model (nothing was loaded): "
            + " | ".join(problems)
            + ". Keys are the unwrapped module's (no 'module.' prefixes); pass strict=False "
            "to load a subset"
        )
    return IncompatibleKeys(missing, unexpected)


@torch.no_grad()
def load_full_state_dict(
    root: FSDPModule, sd: dict[str, Any], strict: bool = True, rank0_only: bool = False
) -> IncompatibleKeys:
    """Load a full state dict present on every rank into the shards (no communication)."""
    units = _check_idle(root, "load a state dict")
    if rank0_only:
        sd = collectives.broadcast_object(sd, root.process_group)
    result = _validate(root, sd, strict)
    keys = {id(m): (f"{p}." if p else "") for p, m in clean_named_modules(root)}
    for unit in units:
        unit._reshard()
        for flat in unit._flat_params:
            found = [_find_key(sd, keys, slot.locations) for slot in flat.slots]
            # strict=False with keys absent: keep those parameters' current values
            current = flat.gather_fp32() if None in found else None
            pieces = []
            for slot, key in zip(flat.slots, found):
                if key is None:
                    pieces.append(current[slot.offset : slot.offset + slot.numel])
                else:
                    pieces.append(sd[key].detach().reshape(-1).to(flat.shard.device, flat.shard.dtype))
            flat.load_full(torch.cat(pieces))
    for prefix, module in clean_named_modules(root):
        pre = f"{prefix}." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None and pre + name in sd:
                p.copy_(sd[pre + name])
        for name, buf in _persistent_buffers(module):
            if pre + name in sd:
                buf.copy_(sd[pre + name])
    return result


def _find_key(sd: dict[str, Any], keys: dict[int, str], locations) -> str | None:
    for module, attr in locations:
        key = keys.get(id(module), "?") + attr
        if key in sd:
            return key
    return None


def summon_full_params(root: FSDPModule, **options: Any):
    raise NotImplementedError("summon_full_params: issue 4, in progress")
