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

[Note: what param_init_fn receives]
``param_init_fn(module)`` is called with the module's own tensors still on the meta
device, as FSDP1 calls it, so its users' functions (test ``is_meta``, then ``to_empty(...,
recurse=False)`` and ``reset_parameters()``) work unchanged. A function that leaves
tensors on meta -- one that writes into real tensors in place, or ``no_init`` -- is
called again on real, NaN-filled storage. Either way every ``empty`` allocation made
while it runs is NaN (``_EmptyIsNaN``), so storage no init writes stays NaN, and the
first forward of the unit refuses NaN shards naming the parameters
(``checks.check_initialized``), unless a load wrote them since. While the plan is made,
the function runs on a shallow copy of each module with meta copies of its own tensors,
so the RNG advances as it will when the unit materializes the module.

[Note: Hugging Face models]
A module inside a Hugging Face ``PreTrainedModel`` (found by duck typing: the nearest
enclosing module with ``_init_weights``, e.g. the root, or a PeftModel's base model) is
initialized as the eager build does it when no ``param_init_fn`` is given: its
``reset_parameters()`` if it has one (construction), then the model's
``_init_weights(module)`` on it and on each of its ancestors (``post_init`` applies it to
every module, children first; an ancestor may set a child's weights, e.g. GPT-2's scaled
``c_proj``), the ancestors writing into this module's tensors only. The distributions are
HF's own, but the values are not the eager build's: eagerly, construction draws from the
RNG for every module before ``post_init`` draws again, while here each module draws both at
once. Default inits must write every parameter and persistent float buffer (storage starts
as NaN): a module that neither ``reset_parameters()`` nor HF initializes is an error.

Non-persistent buffers (rotary ``inv_freq``, BERT's ``position_ids``) are computed in
``__init__``, are in no state dict and so in no checkpoint: on the meta device they hold
nothing. In transformers 5.x, ``_init_weights`` recomputes them (it is how
``from_pretrained`` fills them), so inside a HF model they come from ``_init_weights``
whatever ``param_init_fn`` is (``no_init`` included); elsewhere from the module's own init.
Each is checked to be fully written (two runs from different fills must agree), or wrapping
fails naming it.

[Note: memory]
Beyond the shards, wrapping holds one unit's full parameters at a time (its modules are
materialized, flattened into the shard, then freed) and, at first, the plan: one recorded RNG
state per module with meta tensors, a 5 KiB CPU tensor each (the Mersenne Twister's state;
CUDA's is 16 bytes). Those add up on many small modules -- the 202 of a 34-unit GPT of 1.7M
parameters were 0.15x the model -- so ``materialize`` drops each state once used and the
plan holds no tensors after wrapping, however long something keeps it alive.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_lite.core import devices

InitFn = Callable[[nn.Module], None]
HFInit = tuple[nn.Module, InitFn]  # (module, the _init_weights of its nearest HF model)


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
    # id(module) -> the RNG state before its init
    states: dict[int, devices.RngState] = field(default_factory=dict)
    owner: dict[int, int] = field(default_factory=dict)  # id(meta param) -> id(its module)
    where: dict[int, list[tuple[nn.Module, str]]] = field(default_factory=dict)  # registrations
    real: dict[int, nn.Parameter] = field(default_factory=dict)  # id(meta param) -> real one
    hf: dict[int, list[HFInit]] = field(default_factory=dict)  # id(module) -> _hf_chains
    rebuilt: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # non-persistent
    done: set[int] = field(default_factory=set)  # id(module) materialized (its state dropped)


def _hf_chains(root: nn.Module) -> dict[int, list[HFInit]]:
    """id(module) -> [(module or an ancestor, its nearest HF model's ``_init_weights``)],
    nearest first, for the modules inside a Hugging Face model (see the note)."""
    chains: dict[int, list[HFInit]] = {}

    def visit(module: nn.Module, owner: InitFn | None, above: list[HFInit]) -> None:
        if id(module) in chains:
            return
        own = getattr(module, "_init_weights", None)
        owner = own if callable(own) else owner
        chain = [(module, owner), *above] if owner is not None else above
        chains[id(module)] = chain
        for child in module._modules.values():
            if child is not None:
                visit(child, owner, chain)

    visit(root, None, [])
    return {k: v for k, v in chains.items() if v}


class _WritesOnly(TorchDispatchMode):
    """Within the block, in-place ops on real tensors other than ``tensors`` are skipped: an
    ancestor's ``_init_weights`` may set only the module being initialized."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in tensors}

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: object,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> object:
        target = args[0] if args else None
        if (
            func._schema.is_mutable
            and isinstance(target, torch.Tensor)
            and not target.is_meta
            and target.untyped_storage().data_ptr() not in self.storages
        ):
            return target
        return func(*args, **(kwargs or {}))


def _hf_init(module: nn.Module, chain: list[HFInit]) -> None:
    with torch.no_grad(), _WritesOnly(list(_own_tensors(module))):
        for target, init_weights in chain:
            init_weights(target)


def _initialize(module: nn.Module, plan: InitPlan, name: str) -> None:
    """fsdp_lite's default init, on ``module``'s own tensors made real (``_scratch``)."""
    chain = plan.hf.get(id(module), [])
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif not chain:
        raise RuntimeError(
            f"fsdp_lite: module '{name}' ({type(module).__name__}) is on the meta device and "
            "has no reset_parameters(): pass FSDPModule(..., param_init_fn=fn), where "
            "fn(module) initializes that module's own parameters and buffers"
        )
    _hf_init(module, chain)


# The ops that allocate storage without writing it (what ``nn.Module.to_empty`` runs).
EMPTY_OPS = frozenset(
    {
        torch.ops.aten.empty_like.default,
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
    }
)


class _RecordOps(TorchDispatchMode):
    """Records the aten ops run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[torch._ops.OpOverload] = set()

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: object,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> object:
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def allocates_empty(fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Is ``fn`` what ``nn.Module.to_empty`` applies to each tensor (new storage, no copy)?"""
    with _RecordOps() as record:
        fn(torch.zeros(1))
    copies = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
    return bool(record.ops & EMPTY_OPS) and not record.ops & copies


class _EmptyIsNaN(TorchDispatchMode):
    """Within the block, every new floating-point tensor made with ``empty`` (what
    ``to_empty`` allocates) is NaN, never whatever memory held: storage no init writes
    stays NaN, which the first forward refuses (``checks.check_initialized``)."""

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: object,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> object:
        out = func(*args, **(kwargs or {}))
        if func in EMPTY_OPS and out.is_floating_point() and not out.is_meta:
            out.fill_(math.nan)
        return out


def _user_init(module: nn.Module, plan: InitPlan) -> bool:
    """Call ``param_init_fn`` on ``module`` with its own tensors still on the meta device,
    as FSDP1 does (its users' functions test ``is_meta`` and call ``to_empty`` and
    ``reset_parameters`` themselves). True if the function materialized them all; False
    if it left some on meta (a function that writes into real tensors, or ``no_init``):
    the caller then gives them real, NaN-filled storage and calls it again."""
    with _EmptyIsNaN():
        plan.init_fn(module)
    return not _has_own_meta(module)


def _check_written(module: nn.Module, name: str, fresh: list[str]) -> None:
    """Refuse default-initialized storage left NaN (what ``_scratch(fill=nan)`` put there)."""
    tensors = {**module._parameters, **module._buffers}
    left = [
        a
        for a in fresh
        if a not in module._non_persistent_buffers_set
        and tensors[a].is_floating_point()
        and bool(tensors[a].isnan().any())
    ]
    if left:
        raise RuntimeError(
            f"fsdp_lite: module '{name}' ({type(module).__name__}) is on the meta device and "
            f"its default init (reset_parameters() or its Hugging Face model's _init_weights) "
            f"left {', '.join(repr(a) for a in left)} uninitialized: pass "
            "FSDPModule(..., param_init_fn=fn), where fn(module) initializes that module's own "
            "parameters and buffers"
        )


def _rebuild_buffers(module: nn.Module, plan: InitPlan, name: str) -> dict[str, torch.Tensor]:
    """The values of ``module``'s meta non-persistent buffers, from its HF model's
    ``_init_weights`` (else its own init), run twice from different fills on scratch copies,
    the RNG restored; a buffer the runs disagree on was not (fully) written: an error."""
    attrs = [
        a
        for a in module._non_persistent_buffers_set
        if module._buffers.get(a) is not None and module._buffers[a].is_meta
    ]
    if not attrs:
        return {}
    chain = plan.hf.get(id(module))
    runs = []
    own = devices.rng_state(plan.device)
    try:
        for fill in (0.0, 1.0):
            devices.set_rng_state(own, plan.device)
            with _scratch(module, plan.device, fill=fill):
                if chain:
                    _hf_init(module, chain)
                elif plan.init_fn is not None:
                    plan.init_fn(module)
                else:
                    _initialize(module, plan, name)
                runs.append({a: module._buffers[a] for a in attrs})
    finally:
        devices.set_rng_state(own, plan.device)
    unset = [a for a in attrs if not torch.equal(runs[0][a], runs[1][a])]
    if unset:
        source = "its Hugging Face model's _init_weights" if chain else "its init"
        raise RuntimeError(
            f"fsdp_lite: module '{name}' ({type(module).__name__}) has non-persistent buffers "
            f"{', '.join(repr(a) for a in unset)} on the meta device that {source} does not "
            "compute: they are in no checkpoint, so nothing would set them. Build that module "
            "outside torch.device('meta'), or pass a param_init_fn that computes them"
        )
    return runs[0]


def make_plan(
    root: nn.Module, init_fn: InitFn | None, device: torch.device, rank0_state: Callable
) -> InitPlan:
    """Record, in module order, the RNG state each module's initialization starts from.

    ``rank0_state(state)`` returns rank 0's RNG state on every rank (a broadcast)."""
    plan = InitPlan(init_fn, device, hf=_hf_chains(root))
    for module in root.modules():
        for attr, p in module._parameters.items():
            if p is not None and p.is_meta:
                plan.where.setdefault(id(p), []).append((module, attr))
                plan.owner.setdefault(id(p), id(module))
    own = devices.rng_state(device)
    devices.set_rng_state(rank0_state(own), device)
    try:
        for name, module in root.named_modules():
            if _has_own_meta(module):
                name = name or type(root).__name__
                if rebuilt := _rebuild_buffers(module, plan, name):
                    plan.rebuilt[id(module)] = rebuilt
                plan.states[id(module)] = devices.rng_state(device)
                if init_fn is not None:  # on a copy: the RNG advances as it will
                    _user_init_on_copy(module, plan)
                    continue
                with _scratch(module, device, fill=math.nan) as fresh:
                    _initialize(module, plan, name)
                    _check_written(module, name, fresh)
    finally:
        devices.set_rng_state(own, device)
    return plan


def _user_init_on_copy(module: nn.Module, plan: InitPlan) -> None:
    """Run ``param_init_fn`` as ``materialize`` will (``_user_init``, then on real storage
    if it left meta tensors), on a shallow copy of ``module`` whose own tensors are meta
    copies: nothing of the model changes, the RNG advances as it will then."""
    copy = module.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    copy._parameters = {
        a: None if p is None else nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
        for a, p in module._parameters.items()
    }
    copy._buffers = {a: None if b is None else b.to("meta") for a, b in module._buffers.items()}
    copy._modules = dict(module._modules)
    if not _user_init(copy, plan):
        with _scratch(copy, plan.device, fill=math.nan):
            plan.init_fn(copy)


class _scratch:
    """Within the block, ``module``'s own meta tensors are real tensors on ``device``,
    empty or filled with ``fill`` (NaN: floats
    only); afterwards the originals are back. The block gets the names of the new tensors."""

    def __init__(self, module: nn.Module, device: torch.device, fill: float | None = None) -> None:
        self.module, self.device, self.fill = module, device, fill

    def _new(self, t: torch.Tensor) -> torch.Tensor:
        real = torch.empty_like(t, device=self.device)
        if self.fill is not None and (real.is_floating_point() or not math.isnan(self.fill)):
            real.fill_(self.fill)
        return real

    def __enter__(self) -> list[str]:
        m = self.module
        self.params, self.buffers = dict(m._parameters), dict(m._buffers)
        fresh = []
        for attr, p in self.params.items():
            if p is not None and p.is_meta:
                m._parameters[attr] = nn.Parameter(self._new(p), requires_grad=p.requires_grad)
                fresh.append(attr)
        for attr, b in self.buffers.items():
            if b is not None and b.is_meta:
                m._buffers[attr] = self._new(b)
                fresh.append(attr)
        return fresh

    def __exit__(self, *exc: object) -> None:
        self.module._parameters.update(self.params)
        self.module._buffers.update(self.buffers)


def materialize(module: nn.Module, name: str, plan: InitPlan) -> None:
    """Give ``module``'s own tensors real storage and initialize them from the plan.

    Each module's recorded RNG state (5 KiB on CPU) is used once and dropped here, so once
    every unit is built the plan holds no tensors (see the note on memory)."""
    state = plan.states.pop(id(module), None)
    if not _has_own_meta(module):
        return
    if state is None:
        if id(module) in plan.done:  # met again in another unit: its own tensors are real
            _link_tied(module, plan)
            return
        raise RuntimeError(
            f"fsdp_lite: module '{name}' is on the meta device but was not in the model when "
            "its outermost FSDPModule was created"
        )
    plan.done.add(id(module))
    own = devices.rng_state(plan.device)
    devices.set_rng_state(state, plan.device)
    try:
        owned = {
            id(p): p
            for p in module._parameters.values()
            if p is not None and p.is_meta and plan.owner.get(id(p)) == id(module)
        }
        metas, meta_buffers = dict(module._parameters), dict(module._buffers)
        if plan.init_fn is not None and _user_init(module, plan):
            values = {a: p for a, p in module._parameters.items() if p is not None}
            buffers = {a: b for a, b in module._buffers.items() if b is not None}
        else:  # a default init, or a param_init_fn that writes into real storage
            module._parameters.update(metas)
            module._buffers.update(meta_buffers)
            devices.set_rng_state(state, plan.device)
            with _scratch(module, plan.device, fill=math.nan):
                if plan.init_fn is not None:
                    plan.init_fn(module)
                else:
                    _initialize(module, plan, name)
                values = {a: p for a, p in module._parameters.items() if p is not None}
                buffers = {a: b for a, b in module._buffers.items() if b is not None}
        module._parameters.update(metas)  # each registration of a tie is set below
        module._buffers.update(meta_buffers)
        buffers.update(plan.rebuilt.pop(id(module), {}))
        for attr, p in list(module._parameters.items()):  # parameters this module owns
            if p is not None and id(p) in owned:
                real = values[attr]
                plan.real[id(p)] = real
                for other, other_attr in plan.where[id(p)]:  # every registration, ties too
                    other._parameters[other_attr] = real
        _link_tied(module, plan)
        for attr, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[attr] = buffers[attr]
    finally:
        devices.set_rng_state(own, plan.device)


def _link_tied(module: nn.Module, plan: InitPlan) -> None:
    """Point ``module``'s meta parameters that another module owns, and has already
    materialized, at that real parameter (the owner sets every registration it knows)."""
    for attr, p in list(module._parameters.items()):
        if p is not None and p.is_meta and id(p) in plan.real:
            module._parameters[attr] = plan.real[id(p)]
