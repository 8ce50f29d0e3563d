"""The unit tree: which modules are units, and the unwrapped model's names.

An ``FSDPModule`` carries its ``Unit`` in ``__dict__["_fsdp_lite_unit"]``; every lower
module finds units through ``unit_of`` instead of importing the wrapper class, so
dependencies point down (``fsdp.py`` -> ``root.py`` -> ``tree.py`` -> ``unit.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from fsdp_lite.core.unit import Unit

UNIT_ATTR = "_fsdp_lite_unit"


def unit_of(module: nn.Module) -> Unit | None:
    """The ``Unit`` of an ``FSDPModule`` wrapper, else ``None``."""
    return module.__dict__.get(UNIT_ATTR)


def units_of(root: nn.Module) -> list[Unit]:
    """Every unit in ``root``'s tree (``root`` first if it is one), in module order."""
    return [u for m in root.modules() if (u := unit_of(m)) is not None]


# A wrapper module class (activation checkpointing's) names, in this class attribute, the
# attribute that holds the module it wraps: unwrap steps over it without importing it.
WRAPPED_ATTR = "_fsdp_lite_inner"
# Set in the __dict__ of a module an FSDPModule has sharded (wrapped once, never again).
SHARDED_FLAG = "_fsdp_lite_sharded"
# Set in the __dict__ of a module an FSDPModule was told to leave alone (``ignored_modules``,
# see ``ignored.py``): no unit flattens its subtree's parameters or casts its buffers.
IGNORED_FLAG = "_fsdp_lite_ignored"


def is_ignored(module: nn.Module) -> bool:
    """Was ``module`` (with its subtree) left unsharded by an FSDPModule around it?"""
    return bool(module.__dict__.get(IGNORED_FLAG))


def is_sharded(module: nn.Module) -> bool:
    """Has an FSDPModule taken ``module``'s parameters (a unit, or the module a unit wraps)?"""
    return unit_of(module) is not None or bool(module.__dict__.get(SHARDED_FLAG))


def unwrap(module: nn.Module) -> nn.Module:
    """Step over unit and activation-checkpoint wrappers to the user's module."""
    while True:
        unit = unit_of(module)
        if unit is not None:
            module = unit.module
        elif (attr := getattr(type(module), WRAPPED_ATTR, None)) is not None:
            module = getattr(module, attr)
        else:
            return module


def clean_named_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Like ``named_modules`` of the unwrapped model: unit and checkpoint wrappers are
    stepped over."""
    module = unwrap(module)
    yield prefix.rstrip("."), module
    for name, child in module._modules.items():
        if child is not None:
            yield from clean_named_modules(child, f"{prefix}{name}.")


def region_modules(module: nn.Module) -> list[nn.Module]:
    """``module`` and its descendants, not descending into nested units nor into ignored
    modules (each once): the modules whose parameters and buffers the unit manages."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen or unit_of(m) is not None or (m is not module and is_ignored(m)):
            return
        seen.add(id(m))
        out.append(m)
        for child in m._modules.values():
            if child is not None:
                visit(child)

    visit(module)
    return out


def named_as_unwrapped(
    wrapper: nn.Module, inner: nn.Module, memo: set | None, prefix: str, remove_duplicate: bool
) -> Iterator[tuple[str, nn.Module]]:
    """``named_modules`` of a wrapper (a unit's, a checkpoint wrapper) whose module shares
    its name: the names of the unwrapped model, as in ``state_dict()`` keys."""
    memo = set() if memo is None else memo
    if remove_duplicate:
        if wrapper in memo:
            return
        memo.add(wrapper)
    yield prefix, wrapper
    yield from inner.named_modules(memo, prefix, remove_duplicate)
