"""One unit: its flat params, its TrainingState, and the steps its root runs on it.

A unit knows nothing of the units around it: its ``Root`` (``root.py``) calls these
steps in order and decides what to prefetch and what to keep. One step starts here: a
flat param's complete gradient calls ``post_backward``, which reduces it through the
queue of reduce-scatters in flight that the unit shares with its root (``Unit.join``).
Calls go one way: root -> unit -> reduce -> flat param -> collectives. Outside the
step, ``addons/summon.py`` moves a unit in and out of SUMMON_FULL_PARAMS.

    start_forward    check the state and requires_grad; FORWARD
    unshard          issue the gathers (a prefetch), wait_unshard completes them
    use_full_views   the module's parameters become views of the full buffers
    end_forward      reshard unless kept; IDLE
    start_backward   PRE_BACKWARD; views back for a recompute
    post_backward    a flat param's gradient is complete (its hook):
      grad_complete    POST_BACKWARD, free it
      reduce_grad      reduce-scatter (or keep under no_sync) what gradient it holds;
                       the root's queue adds earlier results to their shard grads
    end_backward     the optimizer's parameters see the grads; resharded and IDLE
    abandon_backward after an interrupted backward: its gradients dropped; IDLE

[Note: when a unit's backward is over]
One rule, from two autograd events, for every unit. A trainable flat param is done when
its full gradient is complete: the post-accumulate hook on ``full`` fires,
``grad_complete`` frees it and ``reduce_grad`` reduce-scatters the gradient. A frozen
flat param (LoRA's base weights) gets no gradient, so no such hook tells when backward is
done with it. A node of the backward graph runs only if it leads to something that needs a gradient;
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

[Note: keeping across micro-batches]
With gradients not synced and ``reshard_after_backward`` off (``accumulating``), a unit
frees its full parameters neither after forward nor in or after backward: a step of N
micro-batches gathers once. A backward that syncs frees them (the optimizer step comes
next), and so does ``Unit.end_backward`` after one. When it keeps them the unit records
its shards' versions (``kept_stamp``); the root's next forward frees them unless
``kept_fresh`` (unchanged since), so a load or optimizer step between micro-batches makes
it gather again rather than compute with stale parameters.

[Note: why freeing at the gradient's hook is safe]
A node that reads a weight only for its input's gradient, with no autograd edge to the
weight (``x @ W.detach()``, a custom ``autograd.Function`` handed ``W.detach()``), is not
among the nodes the flat param's gradient waits for: nothing orders it before the
post-accumulate hook that frees ``full``. It runs first only because the autograd engine
runs a device's ready nodes in decreasing creation order (sequence number), and the
parameter views (``FlatParam.use_full_views``: the split whose backward accumulates into
``full``) are made in the root's ``pre_forward``, before any op of the unit's forward; under
activation checkpointing the recompute's nodes are newer still. Views made lazily, after
an op of the unit, would break this: ``tests/unit/test_freeing_order.py`` fails then.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Protocol

import torch
from torch import nn

from fsdp_lite.core import accounting, collectives
from fsdp_lite.core.flat_param import FlatParam
from fsdp_lite.core.home import DeviceHome
from fsdp_lite.core.nested import tensors_in
from fsdp_lite.core.policies import MixedPrecision, PrefetchPolicy
from fsdp_lite.core.reduce import InFlight
from fsdp_lite.core.state import TrainingState, check_state

_BACKWARD_STATES = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)


class TreeRoot(Protocol):
    """What the root of a unit's tree (``root.Root``, which imports this file) offers to
    those who reach it through the unit: the hooks, ``FSDPModule``."""

    units: list[Unit]  # every unit in the tree, the root's own first
    in_flight: InFlight  # its reduce-scatters in flight, in issue order
    replicas: Any  # the tree's ignored parameters (``ignored.Replicas``)

    def post_forward(self, unit: Unit, output: Any) -> None: ...

    def release(self) -> None: ...

    def reset(self) -> None: ...

    def rebuild_schedule(self) -> None: ...


class Unit:
    """The flat params and TrainingState of one ``FSDPModule``."""

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
        ledger: accounting.Ledger,
        fp32_masters: bool = True,
    ) -> None:
        self.module = module  # the user's module: the hooks live on it
        self.process_group = process_group  # parameters are sharded over these ranks
        self.replicate_group = replicate_group  # hybrid: shard grads averaged over it
        self.device = device  # the compute device
        self.mixed_precision = mixed_precision
        self.prefetch = prefetch  # only the root's is read: it applies to the whole tree
        self.reshard_after_forward = reshard_after_forward  # as given; see schedule.build
        self.home = home  # where shards and shard grads live between uses
        self.fp32_masters = fp32_masters  # low-precision parameters get fp32 shards
        self.flat_params: list[FlatParam] = []  # set by own(), after nested units exist
        self.state = TrainingState.IDLE
        self.sync_grads = True  # False inside no_sync() / set_requires_gradient_sync(False)
        # False: keep the full parameters across micro-batches while gradients are not
        # synced (set_reshard_after_backward; see the Note on keeping across micro-batches).
        self.reshard_after_backward = True
        # The shards' versions when full parameters were last kept across a backward or an
        # accumulating forward (None: nothing kept): the next micro-batch reuses them only
        # if the shards did not change since (a load, an optimizer step).
        self.kept_stamp: tuple[int, ...] | None = None
        # The Root (root.py) that runs this unit's step, set at its first forward; the
        # unit itself never calls it.
        self.root: TreeRoot | None = None
        self.is_root = False  # the unit its root was made for
        self.in_flight: InFlight | None = None  # its root's queue of reduce-scatters
        # Its name (the module path, from the root's making on) and its tree's ledger, on
        # every collective it issues.
        self.tag = accounting.Tag(type(module).__name__, ledger)
        self.frozen_early = False  # frozen flat params freed in backward (see Note)
        self.watches: weakref.WeakSet = weakref.WeakSet()  # forward calls awaiting input grads
        self.grads_pending: set[int] = set()  # id of trainable flats not reduced this backward
        self.replicas_synced = False  # hybrid: sync_module_states broadcast rank 0's values
        # Built on meta by a param_init_fn: its first forward refuses storage no init wrote.
        self.check_init = False

    @property
    def name(self) -> str:
        return self.tag.name

    def own(self, flats: list[FlatParam]) -> None:
        """Its flat params; each one's complete gradient calls ``post_backward``."""
        self.flat_params = flats
        for flat in flats:
            # Weak references: autograd holds the hook from C++, where Python's garbage
            # collector cannot see the cycle unit -> flat -> full -> hook -> unit.
            flat.on_grad_complete(
                functools.partial(_grad_complete, weakref.ref(self), weakref.ref(flat))
            )

    def join(self, root: TreeRoot | None, is_root: bool = False) -> None:
        """Run by ``root`` from now on (None: by no root until one takes it)."""
        self.root, self.is_root = root, is_root
        self.in_flight = root.in_flight if root is not None else None

    def set_name(self, name: str, ledger: accounting.Ledger) -> None:
        """Its path in the root's tree, and the root's ledger (the root names every unit
        when it is made)."""
        self.tag = accounting.Tag(name, ledger)
        for flat in self.flat_params:
            flat.name_unit(self.tag, id(self))

    def average_grads_over(self, ranks: int) -> None:
        """Its gradients are averaged over ``ranks`` data-parallel ranks (the root says how
        many: ``checks.mesh_divisor``)."""
        for flat in self.flat_params:
            flat.averaged_over = ranks

    # -- forward -------------------------------------------------------------------

    def start_forward(self) -> bool:
        """FORWARD. True if a flat param was frozen or unfrozen since the last forward."""
        check_state(self.name, self.state, TrainingState.IDLE, doing="run forward")
        changed = torch.is_grad_enabled() and self._follow_requires_grad()
        self.state = TrainingState.FORWARD
        return changed

    def end_forward(self, keep_full: bool) -> None:
        if self.accumulating():
            self.kept_stamp = self._stamp()
        elif not keep_full:
            self.reshard()
        self.state = TrainingState.IDLE

    def accumulating(self) -> bool:
        """Between micro-batches of one step (gradients not synced) with
        ``reshard_after_backward=False``: full parameters stay until a backward that syncs."""
        return not self.reshard_after_backward and not self.sync_grads

    def _stamp(self) -> tuple[int, ...]:
        return tuple(flat.version() for flat in self.flat_params)

    def kept_fresh(self) -> bool:
        """Are full parameters kept across micro-batches still those of the shards as they
        are now (no optimizer step, load or in-place write since)?"""
        return self.kept_stamp is not None and self.kept_stamp == self._stamp()

    def _follow_requires_grad(self) -> bool:
        """Freeze and unfreeze after wrapping: a flat param needs a gradient iff what the
        optimizer sees of it asks for one (``FlatParam.wants_grad``). Ranks that decide
        differently for a flat param (a parameter unfrozen only where a rank holds a piece
        of it) issue different reduce-scatters, which the divergence check reports: change
        ``requires_grad`` alike on every rank, for whole units or modules."""
        changed = False
        for flat in self.flat_params:
            wants = flat.wants_grad()
            if wants != flat.requires_grad:
                flat.set_requires_grad(wants)
                changed = True
        return changed

    # -- gather and free -------------------------------------------------------------

    def unshard(self, async_op: bool) -> None:
        for flat in self.flat_params:
            flat.unshard(async_op=async_op)

    def wait_unshard(self) -> None:
        for flat in self.flat_params:
            flat.wait_unshard()

    def use_full_views(self) -> None:
        """The gathered full parameters' views at the parameter locations (gathered: see
        ``unshard``/``wait_unshard``)."""
        for flat in self.flat_params:
            flat.use_full_views()

    def reshard(self) -> None:
        self.kept_stamp = None
        for flat in self.flat_params:
            flat.reshard()

    # -- backward --------------------------------------------------------------------

    def start_backward(self) -> None:
        """PRE_BACKWARD: every trainable flat param awaits its gradient."""
        self.state = TrainingState.PRE_BACKWARD
        self.grads_pending = {id(f) for f in self.flat_params if f.requires_grad}

    def use_views_again(self) -> None:
        for flat in self.flat_params:
            flat.use_views_again()

    def grad_complete(self, flat: FlatParam) -> bool:
        """``flat``'s full gradient is complete (its post-accumulate hook): free the full
        buffer before the gradient's casts and copies allocate, since no node left in this
        backward reads it (see Note). False in IDLE: the gradient reached the parameters in
        a backward that did not pass through this unit's outputs (a chunked loss through
        the root's head, called outside the root's forward); it stays in the full buffer's
        ``.grad`` until the end of the next backward that does, as FSDP2 does."""
        if self.state is TrainingState.IDLE:
            return False
        check_state(
            self.name,
            self.state,
            *_BACKWARD_STATES,
            doing="run its post-backward hook (its pre-backward hook never ran: were its "
            "outputs detached or passed outside the autograd graph?)",
        )
        self.state = TrainingState.POST_BACKWARD
        if not self.accumulating():
            flat.reshard()
        return True

    def post_backward(self, flat: FlatParam) -> None:
        """``flat``'s full gradient is complete (its hook): free it, reduce-scatter the
        gradient."""
        if self.grad_complete(flat):
            with accounting.region("fsdp_lite::post_backward"):
                self.reduce_grad(flat)

    def reduce_grad(self, flat: FlatParam) -> None:
        """Reduce-scatter the gradient ``flat`` holds through the root's queue (which adds
        earlier results to their shard grads), or keep it under no_sync: the one reduce
        path, from ``post_backward`` and, for every flat param, from the root's end of
        backward. Idempotent: a gradient already taken leaves nothing to do."""
        if not flat.has_leftover_grad(self.sync_grads):
            return
        if self.sync_grads:
            self.in_flight.issue(flat, self.reduce_dtype(flat))
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
        if self.frozen_early and self.state in _BACKWARD_STATES and not self.accumulating():
            if not self.grads_pending and not self.watches:
                for flat in self.flat_params:
                    if not flat.requires_grad:
                        flat.reshard()

    def watch_inputs(self, args: tuple, kwargs: dict, recompute: bool = False) -> None:
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
        """The backward is over and its gradients are in the shard grads (homes settled):
        the optimizer's parameters see them; resharded unless accumulating; IDLE."""
        for flat in self.flat_params:
            flat.link_orig_grads()
        if self.accumulating():
            self.kept_stamp = self._stamp()
        else:
            self.reshard()
        self._idle()

    def abandon_backward(self) -> bool:
        """An interrupted backward (homes settled): drop the gradients it made or did not
        reduce; resharded, IDLE. True if it added some to gradients of earlier backwards,
        where they stay (as in a model without fsdp_lite)."""
        self.drop_unreduced_grads()
        added = False
        for flat in self.flat_params:
            added |= flat.drop_partial_grad()
        self.reshard()
        self._idle()
        return added

    def _idle(self) -> None:
        for flat in self.flat_params:
            flat.views = None  # they belong to this iteration's graph
        self.state = TrainingState.IDLE

    def drop_unreduced_grads(self) -> None:
        """Forget gradients no backward reduced."""
        for flat in self.flat_params:
            if flat.full is not None:
                flat.full.grad = None

    def unreduced_grad(self) -> bool:
        """A gradient kept by ``grad_complete`` in IDLE that no backward reduced yet?"""
        return any(f.full is not None and f.full.grad is not None for f in self.flat_params)


def _grad_complete(unit_ref: weakref.ref, flat_ref: weakref.ref, full: torch.Tensor) -> None:
    unit_ref().post_backward(flat_ref())


class _Watch:
    """One watched forward call; lives as long as its autograd graph."""

    __slots__ = ("__weakref__",)


def _inputs_done(unit_ref: weakref.ref, watch: _Watch) -> None:
    unit = unit_ref()
    if unit is not None:
        unit.inputs_done(watch)


def outside_inference_mode() -> contextlib.AbstractContextManager:
    """Full buffers and their views are made as normal tensors even in inference mode:
    they live for the whole run, and training after an inference-mode forward needs them."""
    if torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return contextlib.nullcontext()
