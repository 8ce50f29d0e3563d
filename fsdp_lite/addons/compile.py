"""Compile the blocks of a model with ``torch.compile``, in a way that composes with units.

[Note: compile the forward, not the call]
A unit's step runs from forward hooks on the wrapped module (see ``root.py``): they gather,
install fresh views of the full buffer at the parameter attributes, prefetch, and reshard.
Those hooks run eagerly around the compiled region, never inside it: dynamo skips them
(``root.register_hooks``), so ``block.compile()`` and ``torch.compile(model)``, before or
after wrapping, compile each block's math with a skipped call at the unit's boundary and
no recompile when each forward installs new parameter views. What this file adds:

- Compiling only ``forward`` leaves ``_call_impl`` and its hooks out of the compiled
  region altogether: one graph per block class with ``fullgraph=True`` (a graph break
  inside a block fails at its first forward instead of silently running in pieces).
- ``torch.compile(block)`` returns an ``OptimizedModule``: an ``_orig_mod.`` in every
  state-dict key, and an auto-wrap policy by block type no longer matches it. Compiling
  ``forward`` keeps the block an instance of its class, so ``wrap.by_type`` still matches
  it, and the state-dict keys are unchanged. The compiled region reads the parameter
  views as graph inputs (guarded by shape, dtype and stride, not identity).

One compiled function per class, ``torch.compile(type(block).forward)``, bound to each block
with ``types.MethodType``: every block of a class shares dynamo's cache for that code (one
graph for all blocks, not one per block), and ``copy.deepcopy`` of the model rebinds the
method to the copy (a compiled bound method would keep running the original block).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_lite.core.tree import is_sharded, unit_of

_MARK = "_fsdp_lite_compiled"  # in a compiled block's __dict__: the compiled function


def compile_blocks(
    model: nn.Module,
    policy_or_types: Callable[[nn.Module], bool] | type[nn.Module] | tuple[type[nn.Module], ...],
    **compile_kwargs: Any,
) -> list[str]:
    """Compile the ``forward`` of every submodule of ``model`` that ``policy_or_types`` picks.

    Call before ``FSDPModule``: ``compile_blocks(model, Block)`` then
    ``FSDPModule(model, auto_wrap_policy=wrap.by_type(Block))``. fsdp_lite's hooks then run
    eagerly around each compiled block (see the Note in ``fsdp_lite/addons/compile.py``).

    Args:
        model: the unwrapped model (compiled in place; a picked ``model`` itself too).
        policy_or_types: a block class, a tuple of them, or a policy ``fn(module) -> bool``
            (e.g. ``wrap.by_type(...)``). A picked module's descendants are not compiled
            separately: they are part of its compiled region.
        compile_kwargs: passed to ``torch.compile`` (``backend``, ``mode``, ``dynamic``,
            ``options``...). ``fullgraph`` defaults to ``True``: a graph break inside a
            block -- including a unit wrapped inside it, whose hooks cannot be traced --
            fails at its first forward instead of silently running in pieces.

    Returns the names of the compiled modules. Raises ``ValueError`` if ``model`` already
    holds a unit (compile before wrapping), if a picked module was compiled already, if
    nothing was picked, or for a mode that captures CUDA graphs (``"reduce-overhead"``,
    ``"max-autotune"``, ``options={"triton.cudagraphs": True}``).
    """
    policy = _as_policy(policy_or_types)
    for name, m in model.named_modules():
        if is_sharded(m):
            where = f"at '{name}'" if name else "the model itself"
            raise ValueError(
                f"fsdp_lite.compile_blocks: the model already holds an FSDPModule unit "
                f"({where}); compile the blocks before wrapping the model"
            )
    _refuse_cuda_graphs(compile_kwargs)
    compile_kwargs.setdefault("fullgraph", True)
    compiled_by_class: dict[type, Callable] = {}
    names: list[str] = []
    for name, module in _picked(model, policy):
        if _MARK in module.__dict__:
            raise ValueError(f"fsdp_lite.compile_blocks: {name or 'the model'} is compiled already")
        cls = type(module)
        if cls not in compiled_by_class:
            compiled_by_class[cls] = torch.compile(cls.forward, **compile_kwargs)
        fn = compiled_by_class[cls]
        module.forward = types.MethodType(_calling(fn, cls.forward), module)
        module.__dict__[_MARK] = fn
        names.append(name)
    if not names:
        raise ValueError(
            f"fsdp_lite.compile_blocks: {policy_or_types!r} picks no module of "
            f"{type(model).__name__}"
        )
    return names


# torch.compile settings that capture CUDA graphs (max-autotune's include them).
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _refuse_cuda_graphs(compile_kwargs: dict[str, Any]) -> None:
    """A CUDA graph replays fixed input addresses: every call would copy the block's full
    parameters (fresh views of a re-gathered buffer each forward) into the graph's static
    inputs, a full extra copy of every unit per step; and a graph pool holds its own
    memory beside the freed full buffers."""
    mode = compile_kwargs.get("mode")
    options = compile_kwargs.get("options") or {}
    if mode in _CUDA_GRAPH_MODES or options.get("triton.cudagraphs"):
        what = f"mode={mode!r}" if mode in _CUDA_GRAPH_MODES else "options['triton.cudagraphs']"
        raise ValueError(
            f"fsdp_lite.compile_blocks: {what} captures CUDA graphs, which would copy each "
            "block's full parameters into the graph's static inputs at every call (a unit "
            "gathers them into a fresh buffer each forward). Use the default mode, or "
            "mode='max-autotune-no-cudagraphs'"
        )


def is_compiled(module: nn.Module) -> bool:
    """Was ``module``'s forward compiled by :func:`compile_blocks`?"""
    return _MARK in module.__dict__


def _calling(fn: Callable, original: Callable) -> Callable:
    """``fn(self, ...)``, and on a graph break the unit inside ``self`` that caused it; with
    ``original``'s name and signature (``inspect.signature(block.forward)`` still works)."""

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            inner = [n for n, m in self.named_modules() if n and unit_of(m) is not None]
            if inner:
                raise ValueError(
                    f"fsdp_lite.compile_blocks: the compiled {type(self).__name__} holds the "
                    f"unit(s) {', '.join(inner)}, whose hooks cannot run inside a compiled "
                    "region; make the compiled blocks the units (auto_wrap_policy by the same "
                    "classes), or compile the modules inside them"
                ) from e
            raise

    return forward


def _as_policy(
    policy_or_types: Callable[[nn.Module], bool] | type[nn.Module] | tuple[type[nn.Module], ...],
) -> Callable[[nn.Module], bool]:
    classes = (policy_or_types,) if isinstance(policy_or_types, type) else policy_or_types
    if isinstance(classes, tuple) and classes:
        if all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            return lambda m: isinstance(m, classes)
    elif callable(classes):
        return classes
    raise TypeError(
        f"fsdp_lite.compile_blocks needs nn.Module classes or a policy, got {policy_or_types!r}"
    )


def _picked(model: nn.Module, policy: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for each module ``policy`` picks, outermost first, each once; not
    below a picked module, never a ModuleList/ModuleDict (no forward of its own)."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(module: nn.Module, name: str) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if not isinstance(module, nn.ModuleList | nn.ModuleDict) and policy(module):
            out.append((name, module))
            return
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, f"{name}.{child_name}" if name else child_name)

    visit(model, "")
    return out
