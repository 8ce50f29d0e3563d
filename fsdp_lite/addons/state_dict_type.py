"""FSDP1's ``state_dict_type``: which state dict ``state_dict()`` and ``load_state_dict()``
of a wrapped model produce and read.

FSDP1 users write ``with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
sd = model.state_dict()``. The setting is kept in the ``__dict__`` of every ``FSDPModule``
in the tree of the module passed (no module-level state: two models are set apart), and
each wrapper's ``state_dict`` / ``load_state_dict`` reads its own:

- ``FULL_STATE_DICT`` (the default, or ``"full"``): ``state_dict.full_state_dict`` and
  ``load_full_state_dict``, with ``FullStateDictConfig.rank0_only`` as their ``rank0_only``.
  The values are always fp32 CPU tensors (``offload_to_cpu=False`` is accepted and gives
  CPU tensors too: one flat param at a time is all a rank holds on the device).
- ``SHARDED_STATE_DICT`` (``"sharded"``): ``checkpoints.sharded_state_dict`` and
  ``load_sharded_state_dict``, the model part of ``save_checkpoint``'s DCP layout.
- ``LOCAL_STATE_DICT``: refused (raw flat shards, tied to one world size and wrapping).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from torch import nn
from torch.distributed.fsdp import (
    FullStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

from fsdp_lite.addons import checkpoints, state_dict
from fsdp_lite.core.tree import unit_of

ATTR = "_fsdp_lite_state_dict_type"  # in each FSDPModule's __dict__: its Setting
# Constants (read-only): the names accepted for each type, and each type's config class.
_NAMES = types.MappingProxyType(
    {
        "full": StateDictType.FULL_STATE_DICT,
        "sharded": StateDictType.SHARDED_STATE_DICT,
        "local": StateDictType.LOCAL_STATE_DICT,
    }
)
_CONFIGS = types.MappingProxyType(
    {
        StateDictType.FULL_STATE_DICT: FullStateDictConfig,
        StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig,
    }
)


@dataclasses.dataclass(frozen=True)
class Setting:
    type: StateDictType
    config: StateDictConfig

    @property
    def sharded(self) -> bool:
        return self.type is StateDictType.SHARDED_STATE_DICT

    def settings(self) -> StateDictSettings:
        """As FSDP1's ``get_state_dict_type`` returns it (no optimizer config here)."""
        return StateDictSettings(self.type, self.config, None)


def resolve(kind: Any, config: Any, optim_config: Any) -> Setting:
    """Check what the user passed (torch's enum member or ``"full"``/``"sharded"``, and the
    config that goes with it); raise saying what to pass instead."""
    if isinstance(kind, str):
        if kind.lower() not in _NAMES:
            raise ValueError(
                f"state_dict_type: unknown type {kind!r}: pass 'full', 'sharded' or "
                "torch.distributed.fsdp.StateDictType.FULL_STATE_DICT / SHARDED_STATE_DICT"
            )
        kind = _NAMES[kind.lower()]
    if not isinstance(kind, StateDictType):
        raise TypeError(
            "state_dict_type takes torch.distributed.fsdp.StateDictType.FULL_STATE_DICT or "
            f"SHARDED_STATE_DICT (or 'full' / 'sharded'), got {kind!r}"
        )
    if kind is StateDictType.LOCAL_STATE_DICT:
        raise ValueError(
            "fsdp_lite has no LOCAL_STATE_DICT (a rank's raw flat shards, readable only at "
            "the same world size and wrapping): use StateDictType.SHARDED_STATE_DICT, whose "
            "ShardedTensors torch.distributed.checkpoint saves and reshards on load"
        )
    if optim_config is not None:
        raise NotImplementedError(
            "fsdp_lite has no FSDP.optim_state_dict, so no optim_state_dict_config: use "
            "fsdp_lite.full_optim_state_dict(model, optimizer) for a full optimizer state "
            "dict, or fsdp_lite.save_checkpoint(path, model, optimizer) for a sharded one"
        )
    want = _CONFIGS[kind]
    config = want() if config is None else config
    if not isinstance(config, want):
        raise TypeError(
            f"{kind.name} takes a torch.distributed.fsdp.{want.__name__} (or None), got "
            f"{type(config).__name__}"
        )
    if getattr(config, "_use_dtensor", False):
        raise ValueError(
            "fsdp_lite's sharded state dict holds ShardedTensors (a rank's part of a parameter "
            "is a few uneven boxes, which no DTensor placement describes); DCP reads them "
            "the same way: leave ShardedStateDictConfig._use_dtensor False"
        )
    return Setting(kind, config)


def wrappers(module: nn.Module) -> list[nn.Module]:
    """Every FSDPModule in ``module``'s tree (``module`` first if it is one)."""
    found = [m for m in module.modules() if unit_of(m) is not None]
    if not found:
        raise ValueError(
            f"state_dict_type: {type(module).__name__} holds no fsdp_lite.FSDPModule: pass "
            "the wrapped model"
        )
    return found


def default() -> Setting:
    """What a wrapper makes until told otherwise: FSDP1's default too."""
    return Setting(StateDictType.FULL_STATE_DICT, FullStateDictConfig())


def setting_of(wrapper: nn.Module) -> Setting:
    return wrapper.__dict__.get(ATTR) or default()


def set_on(module: nn.Module, setting: Setting) -> list[tuple[nn.Module, Setting | None]]:
    """Give every FSDPModule of ``module``'s tree ``setting``; return what each had."""
    before = [(w, w.__dict__.get(ATTR)) for w in wrappers(module)]
    for w, _ in before:
        w.__dict__[ATTR] = setting
    return before


def restore(before: list[tuple[nn.Module, Setting | None]]) -> None:
    for w, setting in before:
        if setting is None:
            w.__dict__.pop(ATTR, None)
        else:
            w.__dict__[ATTR] = setting


def module_state_dict(wrapper: nn.Module, rank0_only: bool | None) -> dict[str, Any]:
    """``FSDPModule.state_dict``'s dict, as ``wrapper``'s setting says (collective)."""
    setting = setting_of(wrapper)
    if setting.sharded:
        if rank0_only:
            raise ValueError(
                "state_dict(rank0_only=True) makes a full state dict; under "
                "SHARDED_STATE_DICT every rank returns its own part: leave rank0_only out, "
                "or use StateDictType.FULL_STATE_DICT"
            )
        return checkpoints.sharded_state_dict(wrapper, setting.config.offload_to_cpu)
    if rank0_only is None:
        rank0_only = setting.config.rank0_only
    return state_dict.full_state_dict(wrapper, rank0_only=rank0_only)


def load_module_state_dict(
    wrapper: nn.Module, sd: dict[str, Any], strict: bool, rank0_only: bool | None
) -> state_dict.IncompatibleKeys:
    """``FSDPModule.load_state_dict``, as ``wrapper``'s setting says (collective)."""
    setting = setting_of(wrapper)
    if setting.sharded:
        if rank0_only:
            raise ValueError(
                "load_state_dict(rank0_only=True) reads a full state dict on rank 0; under "
                "SHARDED_STATE_DICT every rank loads its own part: leave rank0_only out, or "
                "use StateDictType.FULL_STATE_DICT"
            )
        return checkpoints.load_sharded_state_dict(wrapper, sd, strict=strict)
    if rank0_only is None:
        rank0_only = setting.config.rank0_only
    return state_dict.load_full_state_dict(wrapper, sd, strict=strict, rank0_only=rank0_only)
