"""Tensors inside the nested structures modules take and return (tuples, lists, dicts,
dataclasses such as Hugging Face's ``ModelOutput``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map


def tensors_in(obj: Any, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Every tensor in nested tuples, lists, mappings and dataclass instances."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    if isinstance(obj, Mapping):
        values = list(obj.values())
    elif isinstance(obj, list | tuple):
        values = list(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    else:
        return
    seen.add(id(obj))
    for value in values:
        yield from tensors_in(value, seen)


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a nested structure to ``dtype``."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def hook_gradient_nodes(output: Any, hook: Callable[..., Any]) -> None:
    """Call ``hook`` when a gradient reaches ``output``: one hook per autograd node that
    made a tensor of it needing a gradient (a pre-hook: it runs after the tensor hooks on
    the same gradient), on the tensor itself where it is a leaf. Outputs are found in
    tuples, lists, dicts, dataclasses (HF ``ModelOutput``)."""
    nodes = set()
    for t in tensors_in(output):
        if not t.requires_grad:
            continue
        if t.grad_fn is None:
            t.register_hook(hook)
        elif t.grad_fn not in nodes:
            nodes.add(t.grad_fn)
            t.grad_fn.register_prehook(hook)
