"""One unit's state and its step, run from hooks on the wrapped module.

[Note: hooks on the wrapped module]
The step runs from forward hooks registered on the user's module itself (the module
given to ``FSDPModule``), as FSDP2 does, not from the wrapper's ``forward``. Every path
into that module -- the wrapper, Hugging Face's ``generate()`` calling the inner model,
a direct call of an inner block -- therefore gathers before the module runs and
reshards after; the wrapper's ``forward`` is one call of ``self.module``.

One step of one unit, top to bottom in this file:

    pre_forward      (root: lazy init, recover, cast inputs) gather + prefetch, views
    post_forward     hook the outputs for pre-backward; reshard unless kept
    pre_backward     gather again + prefetch (the first output gradient to arrive)
    post_backward    per trainable flat param: reduce-scatter its gradient, reshard
    inputs_done      frozen flat params resharded once the unit's backward is over
    finish_backward  (root, ``runtime.py``) results into shard grads, all units IDLE

[Note: when a unit's backward is over]
One rule, from two autograd events, for every unit. A trainable flat param is done when
its full gradient is complete: the post-accumulate hook on ``full`` fires, and
``post_backward`` frees it and reduce-scatters the gradient. A frozen flat param (LoRA's
base weights) gets no gradient, so no such hook tells when backward is done with it. A
node of the backward graph runs only if it leads to something that needs a gradient;
inside a unit with no nested unit that is either one of the unit's inputs or one of its
own trainable flat params. The autograd engine fires a leaf's accumulation, and a gradient
hook on the inputs, only after every node leading to them ran. So once both have fired --
a ``register_multi_grad_hook`` over the inputs of every watched forward call, and every
trainable flat param's post-backward -- no node that reads the frozen parameters is left,
and they are freed. Units with nested units, or whose modules read another unit's
parameters (a deferred tie), keep the frozen params until the end of backward. (A tensor
that needs a gradient and reaches the unit other than through its arguments -- a module
attribute set by the caller, an object that is not a tuple, list, mapping or dataclass --
is outside this argument.)

[Note: why freeing at the gradient's hook is safe]
A node that reads a weight only for its input's gradient, with no autograd edge to the
weight (``x @ W.detach()``, a custom ``autograd.Function`` handed ``W.detach()``), is not
among the nodes the flat param's gradient waits for: nothing orders it before the
post-accumulate hook that frees ``full``. It runs first only because the autograd engine
runs a device's ready nodes in decreasing creation order (sequence number), and the
parameter views (``FlatParam.use_full_views``: the split whose backward accumulates into
``full``) are made in ``pre_forward``, before any op of the unit's forward; under
activation checkpointing the recompute's nodes are newer still. Views made lazily, after
an op of the unit, would break this: ``tests/unit/test_freeing_order.py`` fails then.

The root's backward starts first and its gradient (the embedding's, which ran first in
forward) completes last, so the root keeps its full parameters through the whole
backward, as FSDP2's does. What keeps that small is what keeps it small in torchtitan:
the embedding and the head get units of their own (``wrap.instances``,
``wrap.embeddings_and_head``), and the root keeps little more than the final norm. A
head tied to the embedding stays in the root (a tied parameter lives in one unit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fsdp_lite.core import accounting, collectives, divergence, runtime, schedule
from fsdp_lite.core.api import MixedPrecision, PrefetchPolicy
from fsdp_lite.core.flat_param import FlatParam, unaveraged
from fsdp_lite.core.home import DeviceHome
from fsdp_lite.core.state import TrainingState, check_state
from fsdp_lite.core.tree import (
    calling_modules,
    clean_named_modules,
    region_modules,
    unit_of,
    unwrap,
)
from fsdp_lite.core.unit_init import check_replicas_agree

_BACKWARD_STATES = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)


class Unit:
    """The flat params, TrainingState and hooks of one ``FSDPModule``."""

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: collectives.ProcessGroup,
        replicate_group: collectives.ProcessGroup | None,
        device: torch.device,
        mixed_precision: MixedPrecision | None,
        prefetch: PrefetchPolicy | None,
        reshard_after_forward: bool | None,
        home: DeviceHome,
    ) -> None:
        self.module = module  # the user's module: the hooks live on it
        self.process_group = process_group  # parameters are sharded over these ranks
        self.replicate_group = replicate_group  # hybrid: shard grads averaged over it
        self.device = device  # the compute device
        self.mixed_precision = mixed_precision
        self.prefetch = prefetch  # only the root's is read: it applies to the whole tree
        self.reshard_after_forward = reshard_after_forward  # as given; see keeps_full_after_forward
        self.home = home  # where shards and shard grads live between uses
        self.flat_params: list[FlatParam] = []  # set by own(), after nested units exist
        self.state = TrainingState.IDLE
        self.sync_grads = True  # False inside no_sync()
        self.is_root: bool | None = None  # decided at the first forward
        self.ctx: runtime.RootContext | None = None  # shared by every unit of the root's tree
        self.name = type(module).__name__  # the module path, from lazy init on
        self.frozen_early = False  # frozen flat params freed in backward (see Note)
        self.watches: weakref.WeakSet = weakref.WeakSet()  # forward calls awaiting input grads
        self.grads_pending: set[int] = set()  # id of trainable flats not reduced this backward
        self.enclosure_checked = False  # see _check_enclosing_modules
        self.replicas_synced = False  # hybrid: sync_module_states broadcast rank 0's values

    def own(self, flats: list[FlatParam]) -> None:
        """Take ``flats`` and hook each full gradient to this unit's post-backward."""
        self.flat_params = flats
        for flat in flats:
            # Weak references: autograd holds the hook from C++, where Python's garbage
            # collector cannot see the cycle unit -> flat -> full -> hook -> unit.
            flat.post_accumulate_hook = functools.partial(
                _post_accumulate, weakref.ref(self), weakref.ref(flat)
            )

    def register_hooks(self) -> None:
        pre, post = _run_eagerly(self.pre_forward), _run_eagerly(self.post_forward)
        self.module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        # always_call: also after an exception in forward, to reshard and return to IDLE.
        self.module.register_forward_hook(post, with_kwargs=True, always_call=True)

    # -- forward -------------------------------------------------------------------

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        self.lazy_init()
        mp = self.mixed_precision
        if self.is_root and mp is not None and mp.cast_inputs:
            args, kwargs = runtime.cast_floats((args, kwargs), mp.param_dtype)
        with _outside_inference_mode():
            if runtime.in_backward():  # activation-checkpoint recompute
                self.pre_backward()
                self.use_full_params()
                self._watch_inputs(args, kwargs, recompute=True)
                return (args, kwargs)
            if self.is_root:
                runtime.recover_if_interrupted(self.ctx)
                runtime.check_no_unreduced_grads(self.ctx)
                runtime.free_kept(self.ctx)
                self._check_enclosing_modules()
            check_state(self.name, self.state, TrainingState.IDLE, doing="run forward")
            if torch.is_grad_enabled():
                self._check_requires_grad()
            self.state = TrainingState.FORWARD
            if self.is_root:
                divergence.start_iteration(self.name, self.process_group, self.device)
                self.ctx.forward_order.start()
            with accounting.region("fsdp_lite::unshard"):
                self.unshard_with_prefetch(backward=False)
                self.use_full_params()
        self._watch_inputs(args, kwargs)
        return (args, kwargs)

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """After forward (``output is None`` also after an exception in it: see
        ``register_hooks``)."""
        if self.state is not TrainingState.FORWARD:
            return  # a recompute in backward, or pre_forward refused to start
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and output is not None:
            self.register_pre_backward(output)
        if output is None or not (grad_enabled and self.keeps_full_after_forward()):
            self.reshard()
        self.state = TrainingState.IDLE
        if self.is_root:
            runtime.end_of_root_forward(self.ctx)

    def _check_requires_grad(self) -> None:
        """Refuse a shard whose ``requires_grad`` changed after wrapping: its flat param
        would keep training (frozen and trainable parameters are flattened apart, at wrap
        time). Orig params differ by rank, so no rank may raise alone: one turned off is
        honoured (it gets no grad, so no optimizer steps it); one turned on in a frozen
        flat param gets none either, with a warning."""
        for flat in self.flat_params:
            if flat.shard.requires_grad != flat.requires_grad:
                names = ", ".join(slot.name for slot in flat.slots[:3])
                more = f" and {len(flat.slots) - 3} more" if len(flat.slots) > 3 else ""
                raise RuntimeError(
                    f"fsdp_lite: requires_grad of a shard of unit '{self.name}' ({names}{more}) "
                    f"changed after wrapping, to {flat.shard.requires_grad}: fsdp_lite "
                    "flattens frozen and trainable parameters apart when it wraps, so it cannot "
                    "follow the change. Set requires_grad on the original parameters before "
                    "wrapping (wrap again to change it), or put it back to "
                    f"{flat.requires_grad}"
                )
            if flat.requires_grad or flat.orig_params is None:
                continue
            thawed = [o.name for o in flat.orig_params if o.param.requires_grad]
            if thawed and not flat.warned_thawed:
                flat.warned_thawed = True
                warnings.warn(
                    f"fsdp_lite: requires_grad was turned on after wrapping for {thawed[:3]} of "
                    f"unit '{self.name}', frozen when it was wrapped: they stay frozen (no "
                    "gradient is computed for them). Set requires_grad before wrapping",
                    stacklevel=2,
                )

    def _check_enclosing_modules(self) -> None:
        """Once, at the first root forward that builds a graph on several ranks: refuse a
        root running inside a module whose trainable parameters belong to no unit (only the
        blocks were wrapped): nothing would average their gradients across ranks."""
        if self.enclosure_checked or not torch.is_grad_enabled():
            return
        self.enclosure_checked = True
        replicas = self.replicate_group
        ranks = collectives.world_size(self.process_group) * (
            collectives.world_size(replicas) if replicas is not None else 1
        )
        if ranks == 1:
            return
        for outer in reversed(calling_modules()):  # outermost first
            if outer is self.module or unit_of(outer) is self:
                break
            loose = _unsharded_trainable(outer)
            if loose:
                shown = ", ".join(loose[:3]) + (
                    f" and {len(loose) - 3} more" if len(loose) > 3 else ""
                )
                raise RuntimeError(
                    f"fsdp_lite: the unit '{self.name}' runs as a root inside "
                    f"{type(outer).__name__}, whose trainable parameters {shown} belong to no "
                    f"unit: nothing averages their gradients across the {ranks} ranks, so the "
                    "ranks would silently diverge. Wrap the whole model -- FSDPModule(model, "
                    "auto_wrap_policy=...) still makes each block its own unit -- or freeze "
                    "those parameters"
                )

    def keeps_full_after_forward(self) -> bool:
        """After a forward that built a graph: keep the full parameters for backward?
        (``schedule.keeps_full_after_forward``, from this unit's facts.)"""
        return schedule.keeps_full_after_forward(
            reshard_after_forward=self.reshard_after_forward, is_root=self.is_root is True
        )

    def lazy_init(self) -> None:
        """Make the first unit to run forward the root of every unit below it."""
        if self.ctx is not None:
            return
        units = [self] + [u for m in self.module.modules() if (u := unit_of(m)) is not None]
        ctx = runtime.RootContext(units=units, prefetch=self.prefetch)
        names = {id(m): n for n, m in clean_named_modules(self.module)}
        for unit in units:
            unit.is_root = unit is self
            unit.ctx = ctx
            path = names.get(id(unwrap(unit.module)), "")
            unit.name = path or f"<root {type(unit.module).__name__}>"
            for flat in unit.flat_params:
                flat.unit_name, flat.unit_key = unit.name, id(unit)
                flat.placeholders = None  # placeholders made from now on name the unit
        for unit in units:
            unit.frozen_early = _frees_frozen_early(unit, units)
            check_replicas_agree(unit)

    # -- gather and free -------------------------------------------------------------

    def unshard_with_prefetch(self, backward: bool) -> None:
        """Issue this unit's gather, then the next units' gathers, then wait for its own."""
        ctx = self.ctx
        ctx.prefetched.discard(self)
        for flat in self.flat_params:
            flat.unshard(async_op=True)
        for other in ctx.next_units(self, backward):
            if schedule.skips_prefetch(
                backward=backward,
                from_root=self.is_root is True,
                target_started=other.state is not TrainingState.IDLE,
            ):
                continue
            ctx.prefetched.add(other)
            for flat in other.flat_params:
                flat.unshard(async_op=True)
        for flat in self.flat_params:
            flat.wait_unshard()

    def use_full_params(self) -> None:
        for flat in self.flat_params:
            flat.unshard()
            flat.use_full_views()

    def reshard(self) -> None:
        for flat in self.flat_params:
            flat.reshard()

    # -- backward --------------------------------------------------------------------

    def register_pre_backward(self, output: Any) -> None:
        """Hook every output that needs a gradient; the first to fire re-gathers. Outputs
        are found in tuples, lists, dicts, dataclasses (HF ``ModelOutput``).

        The hook goes on the node that made the output, not the tensor: the engine runs a
        node's pre-hooks after the tensor hooks on the same gradient, so the unit after this
        one (reading this output as its input) learns that its backward is over, and frees
        its frozen parameters, before this unit gathers (see the Note above)."""
        nodes = set()
        for t in tensors_in(output):
            if not t.requires_grad:
                continue
            if t.grad_fn is None:
                t.register_hook(self._pre_backward_hook)
            elif t.grad_fn not in nodes:
                nodes.add(t.grad_fn)
                t.grad_fn.register_prehook(self._pre_backward_hook)

    def _pre_backward_hook(self, grad: Any) -> None:
        self.pre_backward()

    def pre_backward(self) -> None:
        """Re-gather the full parameters before this unit's backward (once per backward)."""
        ctx = self.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            ctx.backward_order.start()
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(runtime.finish_backward, ctx)
            )
        if self.state is not TrainingState.IDLE:
            return
        with accounting.region("fsdp_lite::pre_backward"):
            self.state = TrainingState.PRE_BACKWARD
            self.grads_pending = {id(f) for f in self.flat_params if f.requires_grad}
            self.unshard_with_prefetch(backward=True)
            for flat in self.flat_params:
                flat.use_views_again()

    def post_backward(self, flat: FlatParam, at_end: bool = False) -> None:
        """Reduce-scatter the gradient ``flat`` holds (or keep it under no_sync): the one
        reduce path. Idempotent: a gradient already taken leaves nothing to do.

        From ``flat``'s hook, once its gradient is complete. In IDLE, the gradient reached
        the parameters in a backward that did not pass through this unit's outputs (a
        chunked loss through the root's head, called outside the root's forward): it stays
        in the full buffer's ``.grad`` until the end of the next backward that does, as
        FSDP2 does. ``at_end``: from the root's end of backward (``runtime.finish_backward``),
        for every flat param, whatever its hook did -- a gradient no hook of this backward
        took (that one, or one kept under no_sync by a unit this backward missed) is
        reduced then, in unit order, the same on every rank."""
        if not at_end:
            if self.state is TrainingState.IDLE:
                return
            check_state(
                self.name,
                self.state,
                *_BACKWARD_STATES,
                doing="run its post-backward hook (its pre-backward hook never ran: were its "
                "outputs detached or passed outside the autograd graph?)",
            )
            self.state = TrainingState.POST_BACKWARD
            # Its gradient is complete, so no node left in this backward reads these
            # parameters: free them before the gradient's casts and copies allocate.
            flat.reshard()
        if not flat.has_leftover_grad(self.sync_grads):
            return
        with accounting.region("fsdp_lite::post_backward"):
            if self.sync_grads:
                runtime.wait_previous_reduce_scatter(self.ctx)
                pending = flat.reduce_scatter_grad(self.reduce_dtype(flat))
                if pending is not None:
                    self.ctx.pending.append(pending)
            else:
                flat.accumulate_unsharded()
            self.grads_pending.discard(id(flat))
            self._free_frozen_if_done()

    def in_backward(self) -> bool:
        return self.state in _BACKWARD_STATES

    def inputs_done(self, watch: object) -> None:
        """The input gradients of one watched forward call are computed."""
        self.watches.discard(watch)
        self._free_frozen_if_done()

    def _free_frozen_if_done(self) -> None:
        if self.frozen_early and self.state in _BACKWARD_STATES:
            if not self.grads_pending and not self.watches:
                for flat in self.flat_params:
                    if not flat.requires_grad:
                        flat.reshard()

    def _watch_inputs(self, args: tuple, kwargs: dict, recompute: bool = False) -> None:
        """With frozen params freed early: a hook on the inputs that need a gradient tells
        when this call's backward is over (the hook, and with it the watch, lives as long
        as the autograd graph does)."""
        if not (self.frozen_early and torch.is_grad_enabled()):
            return
        if recompute and self.watches:
            return  # a non-reentrant recompute: the forward's watch still stands
        tensors = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if not tensors:
            return
        watch = _Watch()
        self.watches.add(watch)
        ref = weakref.ref(self)
        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda grads: _inputs_done(ref, watch), mode="all"
        )

    def reduce_dtype(self, flat: FlatParam) -> torch.dtype:
        """``MixedPrecision``'s, else the master dtype (a module loaded in bf16 computes in
        bf16 and reduces in fp32)."""
        mp = self.mixed_precision
        return flat.shard.dtype if mp is None else mp.effective_reduce_dtype

    def end_backward(self) -> None:
        """Resharded and IDLE, whatever this backward reached."""
        self.reshard()
        for flat in self.flat_params:
            flat.views = None  # they belong to this iteration's graph
        self.state = TrainingState.IDLE


class _Watch:
    """One watched forward call; lives as long as its autograd graph."""

    __slots__ = ("__weakref__",)


def _inputs_done(unit_ref: weakref.ref, watch: _Watch) -> None:
    unit = unit_ref()
    if unit is not None:
        unit.inputs_done(watch)


def _run_eagerly(hook: Any) -> Any:
    """``hook``, never traced by dynamo: where the module's call is compiled
    (``module.compile()``, ``torch.compile(model)``), the hooks run eagerly around the
    compiled forward, as FSDP2's do, instead of putting collectives, storage resizes and
    state changes into the graph (graph breaks inside it, and a recompile whenever a
    hook's branch changes)."""
    return torch._dynamo.disable(hook, recursive=True)


def _frees_frozen_early(unit: Unit, units: list[Unit]) -> bool:
    """Can ``unit`` free its frozen flat params when its backward is over (see Note)?"""
    if all(flat.requires_grad for flat in unit.flat_params):
        return False
    if any(unit_of(m) is not None for m in unit.module.modules()):
        return False  # nested units: nodes here may lead only to their parameters
    region = {id(m) for m in region_modules(unit.module)}
    return not any(
        id(module) in region
        for other in units
        if other is not unit
        for flat in other.flat_params
        for slot in flat.slots
        for module, _ in slot.locations
    )


def _unsharded_trainable(root: nn.Module) -> list[str]:
    """Names of ``root``'s trainable parameters that nothing averages across ranks."""
    named = list(root.named_parameters())
    return [named[i][0] for i in unaveraged([p for _, p in named], root.modules())]


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


def _outside_inference_mode() -> contextlib.AbstractContextManager:
    """Full buffers and their views are made as normal tensors even in inference mode:
    they live for the whole run, and training after an inference-mode forward needs them."""
    if torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return contextlib.nullcontext()


def _post_accumulate(unit_ref: weakref.ref, flat_ref: weakref.ref, full: torch.Tensor) -> None:
    unit_ref().post_backward(flat_ref())
