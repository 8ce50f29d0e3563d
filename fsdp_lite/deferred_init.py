"""Deferred initialization: wrap a model built on the meta device, one unit at a time.

[Note: replaying the eager RNG sequence]
Built eagerly, a model's modules initialize one after another in construction order
(module order), each drawing from the RNG where the previous one left off. Unit by unit,
bottom-up, that order is lost. So, once per model, a *plan* walks the modules in module
order, initializes each module's own tensors on throw-away copies (one module at a time)
and records the RNG state just before it. When a unit later materializes its modules,
each one is initialized from its recorded state, so the values equal the eager build
whatever the unit structure, for modules initialized by ``reset_parameters()`` (or by the
``param_init_fn`` given). The plan starts from rank 0's RNG state, so every rank gets the
same parameters whatever its own seed; each rank's own RNG state is restored afterwards.
A tied parameter is initialized by the first module (in module order) that registers it,
as when a model ties a later module's weight to an earlier one's; the other modules'
inits run on a scratch copy, so the RNG still advances exactly as in the eager build.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

InitFn = Callable[[nn.Module], None]
RngState = tuple[torch.Tensor, torch.Tensor | None]


def no_init(module: nn.Module) -> None:
    """A ``param_init_fn`` that leaves storage uninitialized, for a model whose values come
    from a checkpoint loaded right after wrapping (``fsdp_lite.load_checkpoint``)."""


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for m in module.modules() for t in _own_tensors(m))


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from (p for p in module._parameters.values() if p is not None)
    yield from (b for b in module._buffers.values() if b is not None)


def _has_own_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in _own_tensors(module))


@dataclass
class InitPlan:
    init_fn: InitFn | None
    device: torch.device
    states: dict[int, RngState] = field(default_factory=dict)  # id(module) -> RNG before init
    owner: dict[int, int] = field(default_factory=dict)  # id(meta param) -> id(its module)
    where: dict[int, list[tuple[nn.Module, str]]] = field(default_factory=dict)  # registrations
    real: dict[int, nn.Parameter] = field(default_factory=dict)  # id(meta param) -> real one


def _rng_state(device: torch.device) -> RngState:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: RngState, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _initialize(module: nn.Module, init_fn: InitFn | None, name: str) -> None:
    if init_fn is not None:
        init_fn(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:
        raise RuntimeError(
            f"fsdp_lite: module '{name}' ({type(module).__name__}) is on the meta device and "
            "has no reset_parameters(): pass FSDPModule(..., param_init_fn=fn), where "
            "fn(module) initializes that module's own parameters and buffers"
        )


def make_plan(
    root: nn.Module, init_fn: InitFn | None, device: torch.device, rank0_state: Callable
) -> InitPlan:
    """Record, in module order, the RNG state each module's initialization starts from.

    ``rank0_state(state)`` returns rank 0's RNG state on every rank (a broadcast)."""
    plan = InitPlan(init_fn, device)
    for module in root.modules():
        for attr, p in module._parameters.items():
            if p is not None and p.is_meta:
                plan.where.setdefault(id(p), []).append((module, attr))
                plan.owner.setdefault(id(p), id(module))
    own = _rng_state(device)
    _set_rng_state(rank0_state(own), device)
    try:
        for name, module in root.named_modules():
            if _has_own_meta(module):
                plan.states[id(module)] = _rng_state(device)
                with _scratch(module, device, keep=set()):
                    _initialize(module, init_fn, name or type(root).__name__)
    finally:
        _set_rng_state(own, device)
    return plan


class _scratch:
    """Within the block, ``module``'s own meta tensors are real, empty tensors on ``device``
    (except the parameter ids in ``keep``); afterwards the originals are back."""

    def __init__(self, module: nn.Module, device: torch.device, keep: set[int]) -> None:
        self.module, self.device, self.keep = module, device, keep

    def __enter__(self) -> None:
        m = self.module
        self.params, self.buffers = dict(m._parameters), dict(m._buffers)
        for attr, p in self.params.items():
            if p is not None and p.is_meta and id(p) not in self.keep:
                real = torch.empty_like(p, device=self.device)
                m._parameters[attr] = nn.Parameter(real, requires_grad=p.requires_grad)
        for attr, b in self.buffers.items():
            if b is not None and b.is_meta:
                m._buffers[attr] = torch.empty_like(b, device=self.device)

    def __exit__(self, *exc: object) -> None:
        self.module._parameters.update(self.params)
        self.module._buffers.update(self.buffers)


def materialize(module: nn.Module, name: str, plan: InitPlan) -> None:
    """Give ``module``'s own tensors real storage and initialize them from the plan."""
    if not _has_own_meta(module):
        return
    state = plan.states.get(id(module))
    if state is None:
        raise RuntimeError(
            f"fsdp_lite: module '{name}' is on the meta device but was not in the model when "
            "its outermost FSDPModule was created"
        )
    own = _rng_state(plan.device)
    _set_rng_state(state, plan.device)
    try:
        owned = {
            id(p): p
            for p in module._parameters.values()
            if p is not None and p.is_meta and plan.owner.get(id(p)) == id(module)
        }
        with _scratch(module, plan.device, keep=set()):
            _initialize(module, plan.init_fn, name)
            values = {a: p for a, p in module._parameters.items() if p is not None}
            buffers = {a: b for a, b in module._buffers.items() if b is not None}
        for attr, p in list(module._parameters.items()):  # parameters this module owns
            if p is not None and id(p) in owned:
                real = values[attr]
                plan.real[id(p)] = real
                for other, other_attr in plan.where[id(p)]:  # every registration, ties too
                    other._parameters[other_attr] = real
            elif p is not None and p.is_meta and id(p) in plan.real:
                module._parameters[attr] = plan.real[id(p)]
        for attr, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[attr] = buffers[attr]
    finally:
        _set_rng_state(own, plan.device)
