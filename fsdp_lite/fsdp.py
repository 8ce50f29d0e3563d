"""FSDPModule: the public front of one unit of fully sharded data parallelism.

The unit's state is in ``unit.py``, its step (run from hooks on the wrapped module) in
``root.py``; this class builds the unit at wrap time and holds the public API.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_lite.addons import state_dict as _state_dict
from fsdp_lite.addons import state_dict_type as _sdt
from fsdp_lite.addons.offload import CPUOffload, SSDOffload
from fsdp_lite.build import deferred_init, from_torch_fsdp, ownership
from fsdp_lite.build.unit_init import build_flat_params, install_fp32_modules, prepare_buffers
from fsdp_lite.build.wrap import Policy, apply_policy, unowned_parameters
from fsdp_lite.core import accounting, collectives, devices, ignored, root
from fsdp_lite.core.checks import check_dtensors, check_wrappable
from fsdp_lite.core.grads import nonfinite_units, scale_, total_norm
from fsdp_lite.core.home import DeviceHome
from fsdp_lite.core.policies import MixedPrecision, PrefetchPolicy, resolve_optimizer_params
from fsdp_lite.core.state import TrainingState, check_state
from fsdp_lite.core.tree import (
    SHARDED_FLAG,
    UNIT_ATTR,
    named_as_unwrapped,
    region_modules,
    units_of,
)
from fsdp_lite.core.unit import Unit

DEFAULT_PREFETCH = PrefetchPolicy()


class FSDPModule(nn.Module):
    """Shard ``module``'s parameters across the ranks of ``process_group``.

    The parameters of ``module`` that no nested ``FSDPModule`` owns are flattened into
    one 1-D buffer per (dtype, requires_grad, compute dtype), padded to a multiple of
    the world size W, and rank r keeps its contiguous 1/W slice as an fp32
    ``nn.Parameter`` (the *shard*, the master copy: fp32 also for a module loaded in bf16
    or fp16). ``parameters()`` yields only shards: build the
    optimizer after wrapping. Forward all-gathers the full parameters in the compute
    dtype, runs ``module`` and frees them again; backward re-gathers them and
    reduce-scatters the gradients into the shards' ``.grad`` (averaged over ranks).

    Args:
        module: the module to shard. It may already contain ``FSDPModule`` children
            (wrapped by hand); the outermost unit becomes the root at its first forward.
            It may also be, or contain, a wrapped model that already ran (FSDP1's
            ``FSDP(FSDP(model))``, ``FSDPModule(nn.Sequential(wrapped, head))``): the new
            unit owns only the parameters no unit inside owns, and takes the units inside
            from their old root (they must be IDLE: wrap between iterations). The old
            wrapper keeps working afterwards, as one of the new tree's units (called
            directly, it runs as a nested block does; ``FSDPModule(wrapped)`` puts the new
            root's hooks on it). Pass the new unit the same ``mixed_precision``: only a
            root casts inputs. The module inside a unit (``wrapped.module``) is refused.
        process_group: the ranks to shard over (default: the world group), or a
            ``(shard_group, replicate_group)`` pair for hybrid sharding: shard within the
            first, average shard grads across the second (see ``fsdp_lite.hybrid_groups``).
        auto_wrap_policy: ``policy(submodule) -> bool``; every submodule it picks becomes
            its own unit, bottom-up (see ``fsdp_lite.wrap``). Parameters tied across
            units go to the lowest unit that contains every use.
        reshard_after_forward: free the full parameters after forward and re-gather them
            in backward (``False`` keeps them until the end of backward: less
            communication, more memory). ``None`` (default): ``True`` for every unit but
            the root, whose backward runs first, as FSDP2's default.
        mixed_precision: compute and communication dtypes (``None``: compute in the module's
            own dtype -- fp32, or bf16 for a model loaded in bf16 -- and reduce gradients in
            fp32). ``model.to(dtype)`` after wrapping is refused: it would cast the masters.
        sync_module_states: broadcast parameters and buffers from rank 0 at wrap time.
        device: compute device; default (or ``"cuda"`` without an index): cpu without CUDA,
            else the current CUDA device if set (``torch.cuda.set_device``) or the only one,
            else the default group's ``device_id``, else the launcher's local rank
            (``LOCAL_RANK``, ``SLURM_LOCALID``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
            ``MPI_LOCALRANKID``), or raise.
        prefetch: which all-gathers to issue ahead (see ``PrefetchPolicy``); ``None`` turns
            prefetching off. The root's policy applies to its whole tree.
        offload: where shards and shard grads live between uses: ``CPUOffload()`` (CPU
            memory; the optimizer steps on CPU) or ``SSDOffload(path)`` (memory-mapped files;
            see ``offload_optimizer_state`` for the optimizer's moments). ``None``: the
            compute device.
        param_init_fn: for a model built on the meta device, ``fn(module)`` initializes a
            module's own parameters and buffers (default: reset_parameters(), HF _init_weights);
            each unit materializes and initializes only its own modules (see
            ``deferred_init.py``).
        optimizer_params: what ``parameters()`` yields, so what an optimizer steps:
            ``"flat"`` (default): one fp32 shard per flat param (``flat_param_<i>``), the
            cheapest on the host. ``"pieces"``: this rank's piece of each original
            parameter as an ``nn.Parameter`` view of the shard, under its original name
            (``named_parameters()`` reads as the unwrapped model's, less pieces this rank
            does not hold): per-parameter optimizer groups; a piece cut from a larger
            parameter is 1-D with leading 1s up to its ``ndim``, and matrix optimizers
            refuse it. ``"whole"``: each flat param is sharded on parameter boundaries, so
            each rank owns whole original parameters (``ownership.py``: largest first,
            balanced by bytes over the model), yielded with their names and shapes
            (``torch.optim.Muon`` runs on them unchanged); gathers and reduce-scatters
            take per-rank sizes.
        use_orig_params: FSDP1's name: ``True`` is ``optimizer_params="pieces"``.
        whole_params: ``True`` is ``optimizer_params="whole"`` (the older name).
        fp32_masters: ``True`` (default): the shards of a model loaded in bf16 or fp16 are
            fp32 masters (small updates are not lost to rounding). ``False``: shards, their
            gradients and so the optimizer's state keep the parameters' own dtype, as
            FSDP1 and FSDP2 do: a model made ``.half()`` before wrapping trains in pure
            fp16 (half the memory of the masters; use ``ShardedGradScaler``).
        ignored_modules: FSDP1's: submodules of ``module`` left unsharded with their whole
            subtrees (a replicated head, a module another wrapper such as DDP owns, a frozen
            module): their parameters stay ordinary parameters of their modules, whole on
            every rank and moved to ``device`` (same objects), so ``parameters()`` and
            ``state_dict()`` hold them; no policy wraps them; their buffers keep their dtype
            and the modules compute in their own dtype under ``mixed_precision``. The root
            averages the gradients of trainable ones across all ranks at the end of each
            backward that syncs (not a ``DistributedDataParallel`` module's). Refused: a
            module outside ``module``, one on the meta device, a parameter tied to one that
            is sharded (see ``core/ignored.py``).
        ignored_params: FSDP2's: parameters left unsharded the same way, wherever used.
        mesh: FSDP2's way to give the ranks: a 1-D ``DeviceMesh`` (shard over it) or a 2-D
            one with dims (replicate, shard) (hybrid sharding), usually the data-parallel
            slice of the world mesh (``world["dp"]``, ``world["dp_replicate", "dp_shard"]``).
            Instead of ``process_group``, not with it. Parameters that are DTensors (tensor
            parallel on other dims of the world mesh) keep their placements inside units
            (docs/tensor-parallel.md).
        torch_fsdp_keywords: none is taken: PyTorch FSDP's arguments that fsdp_lite does
            not share (``sharding_strategy``, ``cpu_offload``, ``mp_policy``, ``device_id``,
            ...) are refused with the fsdp_lite argument that does the same, and so are
            FSDP's option objects and wrap policies passed for fsdp_lite's
            (``build/from_torch_fsdp.py``).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: collectives.ProcessGroup
        | tuple[collectives.ProcessGroup, collectives.ProcessGroup]
        | None = None,
        auto_wrap_policy: Policy | None = None,
        reshard_after_forward: bool | None = None,
        mixed_precision: MixedPrecision | None = None,
        sync_module_states: bool = False,
        device: torch.device | str | int | None = None,
        prefetch: PrefetchPolicy | None = DEFAULT_PREFETCH,
        offload: CPUOffload | SSDOffload | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        *,
        optimizer_params: str | None = None,
        use_orig_params: bool = False,
        whole_params: bool = False,
        fp32_masters: bool = True,
        ignored_modules: Iterable[nn.Module] | None = None,
        ignored_params: Iterable[nn.Parameter] | None = None,
        mesh: DeviceMesh | None = None,
        **torch_fsdp_keywords: Any,
    ) -> None:
        from_torch_fsdp.check_keywords(torch_fsdp_keywords)
        from_torch_fsdp.check_options(
            auto_wrap_policy, mixed_precision, offload, prefetch, reshard_after_forward
        )
        super().__init__()
        if mesh is not None:
            process_group = collectives.mesh_groups(mesh, process_group)
        options = _Options(
            process_group, auto_wrap_policy, reshard_after_forward, mixed_precision,
            sync_module_states, device, prefetch, offload, param_init_fn,
            resolve_optimizer_params(optimizer_params, use_orig_params, whole_params),
            fp32_masters=fp32_masters,
        )  # fmt: skip
        ignore = ignored.resolve(module, ignored_modules, ignored_params)
        self._build(module, options, _TreePlan(ignore=ignore))

    def _build(self, module: nn.Module, options: _Options, plan: _TreePlan) -> None:
        """Make this wrapper ``module``'s unit: the outermost one works out the plan of its
        whole tree (deferred init, whole-params owners), and every unit its policy picks is
        built here too, children first, with the same options and plan."""
        o = options
        skip = plan.ignore.param_ids() if plan.ignore is not None else frozenset()
        check_wrappable(module, o.mixed_precision, o.prefetch, o.offload, ignored=skip)
        collectives.require_initialized()
        self.module = module
        # Parameters are sharded over process_group; with hybrid sharding the shard grads
        # are then averaged over replicate_group (None otherwise).
        process_group, replicate_group = collectives.resolve_groups(o.process_group)
        check_dtensors(module, skip, [process_group, replicate_group])
        device = devices.default_device(o.device)
        # The global rank: shard-group ranks repeat across replicas (hybrid sharding), and
        # an SSD directory named by one would be shared by two nodes' ranks.
        rank = collectives.global_rank()
        unit = Unit(
            module,
            process_group=process_group,
            replicate_group=replicate_group,
            device=device,
            mixed_precision=o.mixed_precision,
            prefetch=o.prefetch,
            reshard_after_forward=o.reshard_after_forward,
            fp32_masters=o.fp32_masters,
            home=o.offload.make_home(device, rank) if o.offload else DeviceHome(device),
            ledger=plan.ledger,
        )
        self.__dict__[UNIT_ATTR] = unit
        if plan.ignore is not None:  # the outermost unit leaves them whole (ignored.py)
            ignored.take(
                plan.ignore, self.device, self.process_group, self.replicate_group,
                o.sync_module_states, unit.tag,
            )  # fmt: skip
            plan = dataclasses.replace(plan, ignore=None)
        if plan.init_plan is None and deferred_init.has_meta_tensors(module):
            plan = dataclasses.replace(plan, init_plan=self._plan_deferred_init(module, o))
        # The outermost unit plans whole params' owners for its tree.
        if o.optimizer_params == "whole" and plan.owners is None:
            owners = ownership.plan_owners(list(unowned_parameters(module)), self.process_group)
            plan = dataclasses.replace(plan, owners=owners)
        if o.auto_wrap_policy is not None:
            # apply_policy walks the whole subtree bottom-up: a child applies no policy again
            children = dataclasses.replace(o, device=self.device, auto_wrap_policy=None)
            apply_policy(module, o.auto_wrap_policy, functools.partial(_child, children, plan))
        flats = build_flat_params(
            unit, module, plan.defer, o.sync_module_states, plan.init_plan, plan.owners
        )
        unit.own(flats)
        unit.replicas_synced = o.sync_module_states
        self._register_optimizer_params(o.optimizer_params != "flat")
        prepare_buffers(unit, module, o.sync_module_states)
        install_fp32_modules(region_modules(module), o.mixed_precision)
        module.__dict__[SHARDED_FLAG] = True
        root.register_hooks(unit)
        module._register_state_dict_hook(
            functools.partial(_state_dict.module_state_dict_hook, unit)
        )

    # -- public ------------------------------------------------------------------

    @property
    def training_state(self) -> TrainingState:
        return self._unit.state

    # What the unit was built with (the unit holds them; these read them).
    @property
    def process_group(self) -> collectives.ProcessGroup:
        """The ranks this unit shards over."""
        return self._unit.process_group

    @property
    def replicate_group(self) -> collectives.ProcessGroup | None:
        """With hybrid sharding, the ranks shard grads are averaged across; else None."""
        return self._unit.replicate_group

    @property
    def device(self) -> torch.device:
        return self._unit.device

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        return self._unit.mixed_precision

    @property
    def prefetch(self) -> PrefetchPolicy | None:
        return self._unit.prefetch

    @property
    def reshard_after_forward(self) -> bool | None:
        """As given at wrap time (``None``: the root's schedule decides, ``schedule.build``)."""
        return self._unit.reshard_after_forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; its hooks gather and reshard (see ``root.py``)."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, unsharded, with no communication.

        The first backward outside the context reduce-scatters the sum. Costs one
        unsharded fp32 gradient per flat param for the duration. The same as
        ``set_requires_gradient_sync(False)`` inside, ``True`` after.
        """
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """FSDP2's: ``False`` accumulates gradients unsharded with no communication (as
        ``no_sync``) until set ``True``; the next backward then reduce-scatters the sum.
        ``recurse``: every unit of this module's tree, else this unit only. Between steps or
        micro-batches."""
        for unit in self._idle_units(recurse, "set_requires_gradient_sync"):
            unit.sync_grads = bool(requires_gradient_sync)

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """FSDP2's: ``False`` keeps each unit's full parameters across micro-batches while
        gradients are not synced, so a step of N micro-batches gathers each unit once
        (twice where it is resharded after forward) instead of 2N times; a backward that
        syncs frees them, so the optimizer never steps under them. Costs every unit's full
        parameters at once. Kept parameters are gathered again if the shards changed (an
        optimizer step or a load between micro-batches). See ``docs/how-a-step-works.md``.
        """
        for unit in self._idle_units(recurse, "set_reshard_after_backward"):
            unit.reshard_after_backward = bool(reshard_after_backward)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """FSDP2's: the ``reshard_after_forward`` argument, changed between steps."""
        from_torch_fsdp.check_reshard_after_forward(reshard_after_forward)
        units = self._idle_units(recurse, "set_reshard_after_forward")
        for unit in units:
            unit.reshard_after_forward = bool(reshard_after_forward)
        for owner in {id(u.root): u.root for u in units if u.root is not None}.values():
            owner.rebuild_schedule()

    def _idle_units(self, recurse: bool, doing: str) -> list[Unit]:
        """The units of this tree (``recurse``) or this one, each checked IDLE: ``doing``
        is refused inside a forward or backward."""
        units = self._tree_units() if recurse else [self._unit]
        for unit in units:
            check_state(unit.name, unit.state, TrainingState.IDLE, doing=doing)
        return units

    def set_separate_reduce_scatter_group(self, enable: bool = True) -> None:
        """Reduce-scatter the gradients of every unit in this tree on a process group of
        their own, over the same ranks (one per rank set), so that on NCCL a backward
        prefetch's all-gather need not wait for the previous reduce-scatter: one
        communicator runs one collective at a time. It costs a second communicator's
        buffers. Call between steps on every rank of the shard group -- of the whole
        world where NCCL was initialized eagerly (``init_process_group(device_id=...)``):
        the new group is then a split of the world's communicator, a collective over every
        rank of it. ``False`` goes back to the shared group. (As FSDP2's method of the same
        name; whether it pays on a GPU is unmeasured.)"""
        for unit in self._idle_units(True, "change its groups"):
            for flat in unit.flat_params:
                separate = enable and flat.world_size > 1
                flat.reduce_group = (
                    collectives.separate_group(flat.group) if separate else flat.group
                )

    def _tree_units(self) -> list[Unit]:
        """Every unit in this module's tree, this one first: the root's list once it ran
        (no walk over the module tree, which no_sync and clip would do every step)."""
        unit = self._unit
        if unit.is_root and unit.root is not None:
            return unit.root.units
        return units_of(self)

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale shard grads (and ignored parameters' grads, whole on every rank) so their
        total norm over all ranks is at most ``max_norm``.

        Returns the total norm before clipping (an fp32 scalar tensor, equal on every rank).
        No host synchronization: a non-finite norm (overflow, NaN) leaves the grads
        unscaled, and the caller can skip the step (``if torch.isfinite(norm):
        optimizer.step()``, a sync of its own). ``error_if_nonfinite`` reads the norm on
        the host (a sync) and raises naming the units with non-finite grads.
        """
        units = self._idle_units(True, "clip_grad_norm_")
        flats = [f for u in units for f in u.flat_params]
        grads = [g for f in flats for g in f.grads()]
        parts = [part for f in flats for part in f.norm_parts()]
        whole = self._ignored_grads()
        total = total_norm(
            parts, float(norm_type), self.device, self.process_group, whole, self._unit.tag
        )
        if error_if_nonfinite and not torch.isfinite(total):
            bad = nonfinite_units(units, self.device, self.process_group)
            raise RuntimeError(
                f"fsdp_lite: the gradient norm is {total.item()}; non-finite grads in {bad}"
            )
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
        scale_(grads + whole, coef)
        return total

    def _ignored_grads(self) -> list[torch.Tensor]:
        """The gradients of the ignored parameters in this tree (``ignored.py``): the root's
        list once it ran, else found in the module tree."""
        unit = self._unit
        if unit.is_root and unit.root is not None:
            params = unit.root.replicas.params
        else:
            params = ignored.find(self.module)
        return [p.grad for p in params if p.grad is not None]

    def reset_training_state(self) -> None:
        """After an exception inside backward: return every unit to IDLE, resharded, with no
        reduction in flight, and drop the shard grads that backward made; what it added to
        the grads of earlier backwards (accumulation without ``no_sync``) stays, as in a
        model without fsdp_lite, with a warning. (The root's next forward does this by
        itself, with a warning.)"""
        if self._unit.root is not None:
            self._unit.root.reset()

    def state_dict(
        self,
        *args: Any,
        destination=None,
        prefix: str = "",
        keep_vars: bool = False,
        rank0_only: bool | None = None,
    ):
        """The full, unsharded state dict with the original module's keys, fp32, on CPU
        (or the sharded one under ``SHARDED_STATE_DICT``: see ``state_dict_type``).

        Every rank must call it: it all-gathers one flat param at a time, copies it to
        CPU and frees it before the next, so no rank holds more than one unit's full
        parameters on the device. With ``rank0_only=True`` only rank 0 keeps the copies
        and returns the dict; other ranks get ``{}`` and stay within one flat param of
        their sharded footprint (use it for large models); ``None``: as the
        ``FullStateDictConfig`` of ``state_dict_type`` says (``False`` by default). Loads
        into the unwrapped module and back (``load_state_dict``).
        """
        sd = _sdt.module_state_dict(self, rank0_only)
        if destination is None:
            return {prefix + k: v for k, v in sd.items()} if prefix else sd
        for k, v in sd.items():
            destination[prefix + k] = v
        return destination

    def load_state_dict(
        self,
        state_dict: dict[str, Any],
        strict: bool = True,
        assign: bool = False,
        *,
        rank0_only: bool | None = None,
    ):
        """Load a full state dict (as from ``state_dict()`` or from the unwrapped module),
        or under ``SHARDED_STATE_DICT`` a sharded one (see ``state_dict_type``).

        ``strict`` as in ``nn.Module``: missing or unexpected keys raise unless it is
        ``False``; wrong shapes always raise; on an error nothing is loaded and every rank
        raises. With ``rank0_only=True`` only rank 0's dict is read (others may pass
        ``{}``): it is broadcast one flat param at a time, so no rank holds the full model;
        ``None``: as the ``FullStateDictConfig`` of ``state_dict_type`` says. ``assign``
        is accepted for signature compatibility and ignored (shards are always copied
        into in place, so optimizers stay valid).
        """
        return _sdt.load_module_state_dict(self, state_dict, strict, rank0_only)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: _sdt.StateDictType | str,
        state_dict_config: _sdt.StateDictConfig | None = None,
        optim_state_dict_config: None = None,
    ) -> Iterator[None]:
        """FSDP1's context (``with FSDPModule.state_dict_type(model, StateDictType.
        SHARDED_STATE_DICT): sd = model.state_dict()``): inside, ``state_dict()`` and
        ``load_state_dict()`` of every ``FSDPModule`` in ``module``'s tree make and read
        ``state_dict_type``; on exit each has its previous type back (contexts nest).

        ``state_dict_type``: ``torch.distributed.fsdp.StateDictType.FULL_STATE_DICT`` or
        ``"full"`` (the default outside: full fp32 CPU tensors; ``FullStateDictConfig(
        rank0_only=True)``: rank 0 gets them, the others ``{}``, and ``load_state_dict``
        reads rank 0's dict only), or ``SHARDED_STATE_DICT`` / ``"sharded"``: every rank
        gets copies of its own part of each parameter as ShardedTensors (buffers whole; on
        CPU with ``ShardedStateDictConfig(offload_to_cpu=True)``), for
        ``torch.distributed.checkpoint``: ``dcp.save(sd, checkpoint_id=...)``, and to
        resume ``sd = model.state_dict(); dcp.load(sd, checkpoint_id=...);
        model.load_state_dict(sd)`` (DCP reshards to this world size; the model changes
        at ``load_state_dict``, not at ``dcp.load``). ``LOCAL_STATE_DICT`` is refused:
        use ``SHARDED_STATE_DICT``. The whole checkpoint with optimizer state:
        ``fsdp_lite.save_checkpoint`` (the same model keys, under ``model.``).
        """
        setting = _sdt.resolve(state_dict_type, state_dict_config, optim_state_dict_config)
        before = _sdt.set_on(module, setting)
        try:
            yield
        finally:
            _sdt.restore(before)

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: _sdt.StateDictType | str,
        state_dict_config: _sdt.StateDictConfig | None = None,
        optim_state_dict_config: None = None,
    ) -> _sdt.StateDictSettings:
        """``state_dict_type`` for good (until set again), not as a context: every
        ``FSDPModule`` in ``module``'s tree now makes and reads that type. Returns the
        previous setting of ``module`` (its first ``FSDPModule``), as FSDP1 does."""
        setting = _sdt.resolve(state_dict_type, state_dict_config, optim_state_dict_config)
        before = _sdt.set_on(module, setting)
        return (before[0][1] or _sdt.default()).settings()

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> _sdt.StateDictSettings:
        """The type ``state_dict()`` of ``module`` (its first ``FSDPModule``) makes now."""
        return _sdt.setting_of(_sdt.wrappers(module)[0]).settings()

    def summon_full_params(
        self,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        recurse: bool = True,
        with_grads: bool = False,
    ) -> contextlib.AbstractContextManager[None]:
        """Context: the module's parameters are full fp32 ``nn.Parameter``s under their
        original names and shapes (``named_parameters()``, EMA, custom init work inside).

        Collective on entry (every rank gathers). ``writeback``: edits made inside persist
        in the shards after exit. ``rank0_only``: only rank 0 sees the full parameters
        (others see the module unchanged; needs ``writeback=False``). ``offload_to_cpu``:
        the full copies live on CPU. ``recurse=False``: only this unit's own parameters,
        not those of nested units. ``with_grads``: each parameter's ``.grad`` is its full
        gradient (gathered from the shard grads; None where no rank has one), a copy:
        edits to it are not written back. Units are in ``TrainingState.SUMMON_FULL_PARAMS``
        inside (forward is refused); on exit the full copies are dropped, so memory is
        back to the sharded footprint once nothing else references them.
        """
        from fsdp_lite.addons.summon import summon_full_params

        return summon_full_params(
            self,
            writeback=writeback,
            rank0_only=rank0_only,
            offload_to_cpu=offload_to_cpu,
            recurse=recurse,
            with_grads=with_grads,
        )

    def apply(self, fn: Callable[[nn.Module], None]) -> FSDPModule:
        """As ``nn.Module.apply`` (``fn`` on every submodule, children first), with each
        unit's full parameters summoned (``writeback=True``, one unit at a time:
        ``recurse=False``) while ``fn`` runs on its modules, as FSDP1's: weight init after
        wrapping (``model.apply(model._init_weights)``) writes the shards. Collective:
        every rank calls it."""
        with self.summon_full_params(writeback=True, recurse=False):
            super().apply(fn)
        return self

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        """``model.to(dtype)``, ``.half()``, ``.bfloat16()``... after wrapping would cast the
        master shards (and the optimizer's view of them): refused before anything changes;
        with orig params, so is a move to another device. ``to_empty`` (FSDP2's habit after
        wrapping a meta model) keeps everything: fsdp_lite materialized and initialized the
        shards when it wrapped; initialize again with ``model.apply(fn)``."""
        flats = [f for u in units_of(self) for f in u.flat_params]
        if deferred_init.allocates_empty(fn):
            target = fn(torch.zeros(0)).device
            if target.type != self.device.type:
                raise TypeError(
                    f"fsdp_lite: to_empty(device={target}) after wrapping: the shards were "
                    f"materialized on {self.device} when the model was wrapped. Pass "
                    f"device={target} to FSDPModule instead"
                )
            return self
        orig = [f for f in flats if f.orig_params is not None]
        moved = orig and fn(torch.empty(0, device=orig[0].shard.device)).device
        if orig and moved != orig[0].shard.device:
            raise TypeError(
                f"fsdp_lite: moving a wrapped model to {moved} would cut the optimizer's "
                "parameters (optimizer_params 'pieces' or 'whole': views of the shards) off the "
                "shards. Pass device= to FSDPModule, or move the module before wrapping"
            )
        for dtype in {f.shard.dtype for f in flats} or {torch.float32}:
            probe = fn(torch.empty(0, dtype=dtype))
            if isinstance(probe, torch.Tensor) and probe.dtype != dtype:
                raise TypeError(
                    f"fsdp_lite: casting a wrapped model to {probe.dtype} would cast its "
                    f"{_short(dtype)} master shards. To compute in low precision, pass "
                    f"mixed_precision=fsdp_lite.MixedPrecision(param_dtype={probe.dtype}) "
                    "when wrapping; for pure "
                    f"{probe.dtype} (shards and optimizer state too), cast the module before "
                    "wrapping and pass fp32_masters=False"
                )
        return super()._apply(fn, recurse)

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("_orig_param_names", ()):  # the module's, not the piece
            return getattr(self._modules["module"], name)
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        try:
            return getattr(self._modules["module"], name)
        except AttributeError:
            if name in from_torch_fsdp.REFUSED_METHODS:
                raise from_torch_fsdp.refused_method(name) from None
            raise

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        """As ``nn.Module``'s, under the unwrapped model's names: the wrapper and its module
        share one name, as in ``state_dict()`` keys, so code that matches module names to
        state-dict keys (PEFT's ``get_peft_model_state_dict``) finds them; attribute
        access forwards to the module, so ``get_submodule(name)`` resolves them too."""
        yield from named_as_unwrapped(self, self.module, memo, prefix, remove_duplicate)

    # -- internals ---------------------------------------------------------------

    def _register_optimizer_params(self, orig: bool) -> None:
        """What ``parameters()`` yields: each flat param's shard (``flat_param_<i>``), or with
        ``orig`` this rank's pieces of the original parameters under their names in the
        wrapped module (``named_parameters()`` then reads as the unwrapped model's).
        Attribute access by such a name still reaches the module (``__getattr__``)."""
        names = set()
        for i, flat in enumerate(self._unit.flat_params):
            if not orig:
                self.register_parameter(f"flat_param_{i}", flat.shard)
                continue
            for o in flat.make_orig_params():
                self._parameters[o.name] = o.param
                names.add(o.name)
        self.__dict__["_orig_param_names"] = frozenset(names)

    def _plan_deferred_init(self, module: nn.Module, o: _Options) -> deferred_init.InitPlan:
        def rank0_state(state: object) -> object:
            if o.sync_module_states:  # the values come from rank 0, which may build for real
                return state
            for group in (self.replicate_group, self.process_group):
                if group is not None:
                    state = collectives.broadcast_object(state, group)
            return state

        return deferred_init.make_plan(module, o.param_init_fn, self.device, rank0_state)

    @property
    def _unit(self) -> Unit:
        return self.__dict__[UNIT_ATTR]

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds for the whole tree: shards, shard grads, full params now,
        and the largest unit's full params (what one gather allocates)."""
        units = units_of(self)
        flats = [f for u in units for f in u.flat_params]
        return {
            "shard_bytes": sum(f.shard.numel() * f.shard.element_size() for f in flats),
            "grad_bytes": sum(g.numel() * g.element_size() for f in flats for g in f.grads()),
            "full_bytes_now": sum(f.full_nbytes for f in flats if f.is_unsharded),
            "largest_unit_full_bytes": max(
                (sum(f.full_nbytes for f in u.flat_params) for u in units), default=0
            ),
        }


# PyTorch FSDP's methods that FSDPModule lacks: reading one says what to call instead.
from_torch_fsdp.add_refused_methods(FSDPModule)


def _short(dtype: torch.dtype) -> str:
    """``fp32``, ``bf16``, ``fp16`` (else torch's name)."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return names.get(dtype, str(dtype))


@dataclasses.dataclass(frozen=True)
class _Options:
    """What the user asked of the outermost FSDPModule, in its arguments' order: every unit
    of the tree is built with it."""

    process_group: Any
    auto_wrap_policy: Policy | None
    reshard_after_forward: bool | None
    mixed_precision: MixedPrecision | None
    sync_module_states: bool
    device: torch.device | str | int | None
    prefetch: PrefetchPolicy | None
    offload: Any
    param_init_fn: Callable[[nn.Module], None] | None
    optimizer_params: str  # "flat", "pieces" or "whole"
    fp32_masters: bool = True  # False: shards keep a low-precision model's dtype


@dataclasses.dataclass(frozen=True)
class _TreePlan:
    """What the outermost unit works out for its whole tree (deferred init's plan, the
    whole-params owners, what it leaves unsharded), and per unit the parameters an
    enclosing unit takes (a tie)."""

    init_plan: deferred_init.InitPlan | None = None
    owners: dict[ownership.Location, int] | None = None
    defer: frozenset[int] = frozenset()
    ignore: ignored.Ignored | None = None  # checked, not yet taken (the outermost unit takes it)
    # The tree's accounting: one FSDPModule call builds its units with one.
    ledger: accounting.Ledger = dataclasses.field(default_factory=accounting.Ledger)


def _child(options: _Options, plan: _TreePlan, module: nn.Module, defer: set[int]) -> FSDPModule:
    """A unit the policy picked, built with the tree's options and plan."""
    unit = FSDPModule.__new__(FSDPModule)
    nn.Module.__init__(unit)
    unit._build(module, options, dataclasses.replace(plan, defer=frozenset(defer)))
    return unit


def _ledgers(module: nn.Module | None, doing: str) -> list[accounting.Ledger]:
    """The ledgers of the trees of units in ``module``, each once."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"fsdp_lite.{doing} takes the wrapped model, fsdp_lite.{doing}(model), got "
            f"{module!r}: each model keeps its own figures"
        )
    units = units_of(module)
    if not units:
        raise ValueError(
            f"fsdp_lite.{doing}: {type(module).__name__} holds no FSDPModule: pass the wrapped "
            "model (or a module that contains its wrapped parts, e.g. the pipeline stages "
            "of this rank in an nn.ModuleList)"
        )
    return list({id(u.tag.ledger): u.tag.ledger for u in units}.values())


def stats(module: nn.Module | None = None, wait: bool = False) -> dict[str, Any]:
    """What the wrapped model ``module`` did on this rank since the last
    :func:`reset_stats` of it. Each model counts apart: two wrapped models in one process
    (teacher and student) do not add into each other's figures.

    No host synchronization: on CUDA, ``exposed_s`` counts the waits whose timing events
    the device has reached; ``wait=True`` first waits for the device to reach all of them
    (a host sync, for an exact figure at the end of a run).

    - ``collectives``: per op, calls, bytes (the full buffer each call spans; a ring
      sends (W-1)/W of it) and dtypes. World size 1 communicates nothing. Ops:
      ``all_gather``, ``reduce_scatter``, ``replicate_all_reduce`` (hybrid sharding),
      ``all_reduce`` (e.g. ``clip_grad_norm_``), ``divergence_check`` (a 3-int
      all-gather per collective in the first iteration of each root and after a
      deviation; none in the steady state; see ``set_divergence_check``), and the
      collectives of state dicts, checkpoints and ``summon_full_params``. A
      ``ShardedGradScaler``'s one all-reduce per step belongs to no model: not counted.
    - ``units``: the same per unit (by module path), plus ``exposed_s``.
    - ``exposed_s``: seconds this rank waited on communication that compute had not
      hidden (CPU blocking time; on CUDA the compute stream's stall).
    - ``order_changes``: per direction (``forward``/``backward``), passes that strayed
      from the recorded unit order and replaced it (prefetching is off for the rest of
      such a pass); 0 once the order is stable. Every step counting: the order changes
      every step (data-dependent control flow), so prefetching rarely runs.
    - ``full_bytes_now`` / ``full_bytes_peak``: bytes of gathered full parameters
      allocated now / at the peak; ``unsharded_units_peak``: most units holding full
      parameters at once.

    ``module`` may hold several roots (a rank's pipeline stages): their figures add up,
    and the peaks are then the sum of each root's peak (an upper bound).
    """
    return accounting.read(_ledgers(module, "stats"), wait)


def reset_stats(module: nn.Module | None = None, wait: bool = False) -> None:
    """Start a new accounting period of ``module`` (e.g. a step); live allocations, and
    CUDA waits the device has not reached yet (unless ``wait``, see :func:`stats`), carry
    over."""
    for ledger in _ledgers(module, "reset_stats"):
        ledger.reset(wait)
