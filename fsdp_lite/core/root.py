"""The root of a tree of units: it runs the step of every unit in its tree.

[Note: hooks on the wrapped module]
The step runs from forward hooks registered on the user's module itself (the module
given to ``FSDPModule``), as FSDP2 does, not from the wrapper's ``forward``. Every path
into that module -- the wrapper, Hugging Face's ``generate()`` calling the inner model,
a direct call of an inner block -- therefore gathers before the module runs and
reshards after; the wrapper's ``forward`` is one call of ``self.module``. Each hook
finds the unit's ``Root`` (made at the unit's first forward: the first unit to run
forward becomes the root of every unit below it) and calls it; the root calls the unit.
A flat param's complete gradient goes to its unit (``Unit.post_backward``), which
reduces it through the root's queue of reduce-scatters (``reduce.InFlight``).

One step, top to bottom in this file:

    pre_forward      (root: start_iteration) gather + prefetch, views
    post_forward     hook the outputs for pre-backward; reshard unless the schedule keeps
    pre_backward     queue finish_backward; gather again + prefetch
    finish_backward  leftover gradients through the same reduce path; results into shard
                     grads; every unit resharded and IDLE

The root's backward starts first and its gradient (the embedding's, which ran first in
forward) completes last, so the root keeps its full parameters through the whole
backward, as FSDP2's does. What keeps that small is what keeps it small in torchtitan:
the embedding and the head get units of their own (``wrap.instances``,
``wrap.embeddings_and_head``), and the root keeps little more than the final norm. A
head tied to the embedding stays in the root (a tied parameter lives in one unit).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from fsdp_lite.core import accounting, collectives, devices, divergence, ignored, schedule
from fsdp_lite.core.checks import check_at_first_forward
from fsdp_lite.core.nested import cast_floats, hook_gradient_nodes, tensors_in
from fsdp_lite.core.optimizer_check import loose_parameters, shapes_of
from fsdp_lite.core.reduce import InFlight
from fsdp_lite.core.state import TrainingState, in_backward
from fsdp_lite.core.tree import clean_named_modules, region_modules, unit_of, units_of, unwrap
from fsdp_lite.core.unit import Unit, outside_inference_mode


def register_hooks(unit: Unit) -> None:
    """Hook ``unit``'s module (forward) and full gradients (backward) to its root's step.

    The forward hooks run eagerly, never traced by dynamo: where the module's call is
    compiled (``module.compile()``, ``torch.compile(model)``), they run around the
    compiled forward, as FSDP2's do, instead of putting collectives, storage resizes and
    state changes into the graph (graph breaks inside it, and a recompile whenever a
    hook's branch changes)."""

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        with accounting.region("fsdp_lite::pre_forward"):
            root = unit.root if unit.root is not None else Root(unit)
            return root.pre_forward(unit, args, kwargs)

    def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if unit.root is not None:  # None: making the root raised in the pre-hook
            with accounting.region("fsdp_lite::post_forward"):
                unit.root.post_forward(unit, output)

    release_nested(unit)
    disable = functools.partial(torch._dynamo.disable, recursive=True)
    unit.module.register_forward_pre_hook(disable(pre), prepend=True, with_kwargs=True)
    # always_call: also after an exception in forward, to reshard and return to IDLE.
    unit.module.register_forward_hook(disable(post), with_kwargs=True, always_call=True)


def release_nested(unit: Unit) -> None:
    """A wrapped model wrapped again (``FSDPModule(wrapped)``, ``FSDPModule(nn.Sequential(
    wrapped, head))``): the units nested in ``unit``'s module that already ran under a root
    leave it, so that ``unit``'s tree gets one root at its first forward (``Root.release``;
    ``check_wrappable`` refused it before anything changed unless they are all IDLE)."""
    for old in {id(u.root): u.root for u in units_of(unit.module) if u.root is not None}.values():
        old.release()


class Root:
    """What the root owns for every unit of its tree: the units in order, the recorded
    orders and the schedule built from them, the gathers prefetched and the reduce-scatters
    in flight, and the end-of-backward callback."""

    def __init__(self, unit: Unit) -> None:
        units = [unit] + [u for m in unit.module.modules() if (u := unit_of(m)) is not None]
        for old in {id(u.root): u.root for u in units if u.root is not None}.values():
            old.release()  # units that ran under another root (a unit run directly first)
        # The tree counts in the ledger of the unit it is made for (one FSDPModule call
        # builds its units with one; units wrapped by hand each came with their own).
        self.ledger = unit.tag.ledger
        names = {id(m): n for n, m in clean_named_modules(unit.module)}
        for u in units:
            path = names.get(id(unwrap(u.module)), "")
            u.set_name(path or f"<root {type(u.module).__name__}>", self.ledger)
        for u in units:  # each raises on every rank alike; the next forward checks again
            check_at_first_forward(u, unit)
        # The ignored parameters of the tree, whose gradients this root averages (ignored.py).
        self.replicas = ignored.Replicas(
            unit.module, unit.process_group, unit.replicate_group, unit.tag
        )
        self.replicas.check_agree(unit.device)
        # The reduce-scatters in flight, in issue order. Widened gradients are reduced on a
        # stream of their own on CUDA (reduce._reduce_widened), as FSDP2's reduce-scatter
        # stream.
        self.in_flight = InFlight(devices.new_stream(unit.device))
        for u in units:
            u.frozen_early = _frees_frozen_early(u, units)
            u.join(self, is_root=u is unit)
        self.root_unit = unit
        self.units = units  # every unit in the tree, the root first
        # Where the tree's shards live, each home once (units may share one).
        self.homes = list({id(f.home): f.home for u in units for f in u.flat_params}.values())
        self.prefetch = unit.prefetch  # the root's policy applies to the whole tree
        self.forward_order: schedule.ExecOrder[Unit] = schedule.ExecOrder("forward", self.ledger)
        self.backward_order: schedule.ExecOrder[Unit] = schedule.ExecOrder("backward", self.ledger)
        self.schedule = self._build_schedule()
        self.prefetched: set[Unit] = set()  # gathered ahead, not yet run
        self.callback_queued = False  # the end-of-backward callback of this backward
        self.inputs_checked = False  # see _check_inputs
        self.averaging_queued = False  # _average_alone queued (a backward through no unit)
        self.replicas.watch(functools.partial(_ignored_grad_arrived, weakref.ref(self)))

    def release(self) -> None:
        """Let go of every unit of this tree, between iterations: some of them were wrapped
        again by an outer unit (or are run by a root made for a unit around them), whose
        root takes them at its first forward. A unit of this tree run again afterwards
        joins that root, or makes a root of its own."""
        busy = [u for u in self.units if u.state is not TrainingState.IDLE]
        if busy or self.in_flight.pending or self.callback_queued:
            what = f"unit '{busy[0].name}' is in state {busy[0].state.name}" if busy else (
                "its backward has not finished")  # fmt: skip
            raise RuntimeError(
                f"fsdp_lite: the units of root '{self.root_unit.name}' are taken over by another "
                f"root (a wrapped model wrapped again) in the middle of an iteration: {what}. "
                "Wrap it again, or run the new root, between iterations (after backward "
                "finished; after an exception in backward call reset_training_state() first)"
            )
        for u in self.units:
            u.reshard()  # full parameters the old root kept from its last forward
            if u.root is self:
                u.join(None)
        self.replicas.unwatch()  # the new root averages them

    def _build_schedule(self) -> schedule.Schedule[Unit]:
        return schedule.build(
            self.units,
            self.root_unit,
            lambda u: u.reshard_after_forward,
            self.forward_order.recorded or (),
            self.backward_order.recorded or (),
            self.prefetch,
        )

    def rebuild_schedule(self) -> None:
        """A unit's ``reshard_after_forward`` changed (``set_reshard_after_forward``)."""
        self.schedule = self._build_schedule()

    def _freeze(self, order: schedule.ExecOrder[Unit]) -> None:
        if order.freeze():
            self.schedule = self._build_schedule()

    # -- forward -------------------------------------------------------------------

    def pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> tuple:
        mp = unit.mixed_precision
        if unit.is_root and mp is not None and mp.cast_inputs:
            args, kwargs = cast_floats((args, kwargs), mp.param_dtype)
        with outside_inference_mode():
            if in_backward():  # activation-checkpoint recompute
                self.pre_backward(unit)
                unit.unshard(async_op=False)  # waits for a gather still in flight
                unit.use_full_views()
                unit.watch_inputs(args, kwargs, recompute=True)
                return (args, kwargs)
            if unit.is_root:
                self._start_iteration(args, kwargs)
            if unit.start_forward():  # frozen or unfrozen since
                unit.frozen_early = _frees_frozen_early(unit, self.units)
            if unit.is_root:
                divergence.start_iteration(unit.tag, unit.process_group, unit.device)
                self.forward_order.start()
            with accounting.region("fsdp_lite::unshard"):
                self._unshard(unit, backward=False)
                unit.use_full_views()
        unit.watch_inputs(args, kwargs)
        return (args, kwargs)

    def _start_iteration(self, args: tuple, kwargs: dict) -> None:
        """At the root's forward: recover from an interrupted backward, refuse gradients no
        backward reduced, free full parameters kept from a forward whose backward never
        came, take in orig params given new ``.data``, and (once) check what the inputs were
        computed from."""
        self._recover_if_interrupted()
        self._check_no_unreduced_grads()
        for unit in self.units:
            for flat in unit.flat_params:
                flat.adopt_orig_writes()
        self._free_kept()
        self._check_inputs(args, kwargs)

    def post_forward(self, unit: Unit, output: Any) -> None:
        """After forward (``output is None`` also after an exception in it: see
        ``register_hooks``)."""
        if unit.state is not TrainingState.FORWARD:
            return  # a recompute in backward, or pre_forward refused to start
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and output is not None:
            self._hook_outputs(unit, output)
        keep = output is not None and grad_enabled and unit in self.schedule.keeps_full
        unit.end_forward(keep_full=keep)
        if unit.is_root:
            self._end_forward()

    def _end_forward(self) -> None:
        """Freeze the forward order after the first pass; free gathers nobody used; let every
        home settle its forward's copies (a forward need not be followed by a backward: the
        optimizer may write offloaded shards next)."""
        self._freeze(self.forward_order)
        for unit in self.prefetched:
            if unit.state is TrainingState.IDLE:
                unit.reshard()
        self.prefetched.clear()
        for home in self.homes:
            home.end_of_forward()

    def _recover_if_interrupted(self) -> None:
        """If the last backward never finished (an exception inside it), reset, so the new
        iteration starts clean."""
        if in_backward():
            return
        if self.callback_queued or any(u.in_backward() for u in self.units):
            warnings.warn(
                "fsdp_lite: the previous backward did not finish (did it raise?); resetting "
                "every unit to IDLE and dropping the gradients that backward made",
                stacklevel=5,
            )
            self.reset()

    def reset(self) -> None:
        """Forget an interrupted iteration: every unit resharded and IDLE, nothing in flight,
        the gradients its backward made dropped. Those it added to gradients of earlier
        backwards (accumulation without ``no_sync``) cannot be told apart and stay, as in a
        model without fsdp_lite: a warning says so."""
        self.in_flight.abandon()
        for home in self.homes:
            home.end_of_backward()
        added = False
        for unit in self.units:
            added |= unit.abandon_backward()
        self.prefetched.clear()
        self.callback_queued = False
        self.averaging_queued = False
        if added:
            warnings.warn(
                "fsdp_lite: the interrupted backward added part of its gradients to those of "
                "earlier backwards (accumulation without no_sync), where they stay, as they "
                "would in a model without fsdp_lite: call optimizer.zero_grad() to drop them",
                stacklevel=4,
            )

    def _free_kept(self) -> None:
        """Free full parameters kept from the last forward (the root's,
        ``reshard_after_forward=False``) whose backward never came -- a validation forward
        with grad enabled. Kept full parameters live until their forward's backward ends or
        the next root forward begins, so none is ever used after the optimizer (or a load,
        an EMA, a ``p.data`` write) changed the shards it was gathered from. A backward of
        that earlier forward still to come gathers them again, into the same storage its
        graph saved. Full parameters kept across micro-batches (``Unit.accumulating``) stay
        while the shards' versions say they are unchanged (``Unit.kept_fresh``)."""
        for unit in self.units:
            if unit.state is TrainingState.IDLE and not unit.kept_fresh():
                unit.reshard()

    def _check_no_unreduced_grads(self) -> None:
        """A gradient kept by ``Unit.grad_complete`` in IDLE that no backward reduced would
        silently miss the step it belongs to."""
        for unit in self.units:
            if unit.unreduced_grad():
                unit.drop_unreduced_grads()
                raise RuntimeError(
                    f"fsdp_lite: unit '{unit.name}' got a gradient in a backward that did not "
                    "pass through its outputs (one of its modules called outside its forward, "
                    "e.g. a loss through the root's head), and no backward through its outputs "
                    "followed before this forward: the gradient was never averaged across "
                    "ranks and did not reach the last step. Call backward through the output "
                    "of the model's forward (h.backward(grad_h)) after such partial backwards; "
                    "the gradient has been dropped"
                )

    def _check_inputs(self, args: tuple, kwargs: dict) -> None:
        """Once, at the first root forward that builds a graph on several ranks: refuse
        inputs computed from trainable parameters of no unit (a root inside a module whose
        own parameters nobody wrapped, when only the blocks were): nothing would average
        their gradients across ranks. The inputs' autograd history is walked once, to its
        leaves; the optimizer's first step refuses such parameters too (``optimizer_check``)."""
        if self.inputs_checked or not torch.is_grad_enabled():
            return
        self.inputs_checked = True
        unit = self.root_unit
        replicas = unit.replicate_group
        ranks = collectives.world_size(unit.process_group) * (
            collectives.world_size(replicas) if replicas is not None else 1
        )
        if ranks == 1:
            return
        leaves = [t for t in _graph_leaves(args, kwargs) if isinstance(t, nn.Parameter)]
        loose = loose_parameters(leaves)
        if loose:
            raise RuntimeError(
                f"fsdp_lite: the inputs of the root unit '{unit.name}' were computed from "
                f"{len(loose)} trainable parameter(s) of no fsdp_lite unit (shapes "
                f"{shapes_of(loose)}): nothing averages their gradients "
                f"across the {ranks} ranks, so the ranks would silently diverge. Wrap the "
                "whole model -- FSDPModule(model, auto_wrap_policy=...) still makes each "
                "block its own unit -- or freeze those parameters"
            )

    # -- gather and free -------------------------------------------------------------

    def _unshard(self, unit: Unit, backward: bool) -> None:
        """Issue ``unit``'s gather, then the gathers the schedule prefetches at this point
        of the pass, then wait for its own."""
        self.prefetched.discard(unit)
        unit.unshard(async_op=True)
        order = self.backward_order if backward else self.forward_order
        for other in self.schedule.prefetches(order.visit(unit), backward):
            if backward and other.state is not TrainingState.IDLE:
                continue  # its backward already ran
            self.prefetched.add(other)
            other.unshard(async_op=True)
        unit.wait_unshard()

    # -- backward --------------------------------------------------------------------

    def _hook_outputs(self, unit: Unit, output: Any) -> None:
        """Hook every output that needs a gradient; the first to fire re-gathers.

        The hook goes on the node that made the output, not the tensor: the engine runs a
        node's pre-hooks after the tensor hooks on the same gradient, so the unit after this
        one (reading this output as its input) learns that its backward is over, and frees
        its frozen parameters, before this unit gathers (see unit.py's Note)."""
        hook_gradient_nodes(output, functools.partial(_pre_backward_hook, self, unit))

    def pre_backward(self, unit: Unit) -> None:
        """Re-gather ``unit``'s full parameters before its backward (once per backward)."""
        if not self.callback_queued:
            self.callback_queued = True
            self.backward_order.start()
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        if unit.state is not TrainingState.IDLE:
            return
        with accounting.region("fsdp_lite::pre_backward"):
            unit.start_backward()
            self._unshard(unit, backward=True)
            unit.use_views_again()

    def finish_backward(self) -> None:
        """End of backward: reduce what no hook took, wait for every reduce-scatter, set shard
        grads, reshard, back to IDLE.

        A gradient no post-backward of this backward took (one reached a unit in IDLE, one
        kept under no_sync by a unit this backward missed) is reduced here, through the same
        path, in unit order, the same on every rank. The ignored parameters' gradients are
        averaged (``ignored.py``), issued before the reduce-scatters are waited for."""
        with accounting.region("fsdp_lite::finish_backward"):
            for unit in self.units:
                for flat in unit.flat_params:
                    unit.reduce_grad(flat)
            averaging = self.replicas.start() if self.root_unit.sync_grads else None
            self.in_flight.drain()
            if averaging is not None:
                averaging.finish()
            for home in self.homes:
                home.end_of_backward()
            for unit in self.units:
                unit.end_backward()
            self.prefetched.clear()
            self._freeze(self.backward_order)
            self.callback_queued = False

    def ignored_grad_arrived(self) -> None:
        """A gradient of an ignored parameter was accumulated. A backward that passes
        through no unit's outputs (a loss through an ignored head called outside forward)
        queues no ``finish_backward``: the averaging is queued alone."""
        if self.callback_queued or self.averaging_queued:
            return
        self.averaging_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._average_alone)

    def _average_alone(self) -> None:
        self.averaging_queued = False
        if self.callback_queued:
            return  # a unit's backward began after it: finish_backward averages
        averaging = self.replicas.start() if self.root_unit.sync_grads else None
        if averaging is not None:
            averaging.finish()


def _pre_backward_hook(root: Root, unit: Unit, grad: Any) -> None:
    root.pre_backward(unit)


def _ignored_grad_arrived(root_ref: weakref.ref) -> None:
    root = root_ref()
    if root is not None:
        root.ignored_grad_arrived()


def _graph_leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The leaves (tensors accumulating a gradient) of the autograd history of every tensor
    in ``args`` and ``kwargs``."""
    stack = [t.grad_fn for t in tensors_in((args, kwargs)) if t.grad_fn is not None]
    seen: set = set()
    leaves = []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None:
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _frees_frozen_early(unit: Unit, units: list[Unit]) -> bool:
    """Can ``unit`` free its frozen flat params when its backward is over (unit.py's Note)?"""
    if all(flat.requires_grad for flat in unit.flat_params):
        return False
    if any(unit_of(m) is not None for m in unit.module.modules()):
        return False  # nested units: nodes here may lead only to their parameters
    if ignored.find(unit.module):
        return False  # ignored parameters: nodes here may lead only to them
    region = {id(m) for m in region_modules(unit.module)}
    return not any(
        id(module) in region
        for other in units
        if other is not unit
        for flat in other.flat_params
        for slot in flat.slots
        for module, _ in slot.locations
    )
