"""Memory planner: one rank's peak tensor memory over a training step, before wrapping.

``estimate_memory`` predicts the peak of one rank's compute device over a steady-state
step (forward, backward, optimizer step, after the first step, when optimizer state
exists) for a model, a micro-batch and FSDP settings, without allocating the model (a
meta-device model works). ``plan`` searches the settings that trade speed for memory and
returns the fastest that fits a budget.

How: ``layout`` works out the units and flat params wrapping would build;
``trace`` runs forward and backward once on fake tensors and records when each
activation and gradient storage is live; ``replay`` replays fsdp_lite's step over
that trace (gathers, prefetches, reshards, reduce-scatters, shard grads, optimizer) and
takes the highest point. The breakdown of ``MemoryEstimate`` is the state at that point,
one named term per line (``replay`` documents each), summing to ``peak_bytes``.

What ``peak_bytes`` means: bytes of tensors live on the compute device, what
``torch.cuda.max_memory_allocated`` reports on a GPU (the caching allocator's reserve and
fragmentation are not included). When the compute device is the CPU, CPU-offloaded state
lives in that same memory and is included (CPU offload then saves nothing there); on a GPU
with CPU offload it is reported apart, as ``host_bytes``.

Not modelled: workspaces a kernel allocates for itself (oneDNN's for bf16 matmuls on CPU,
cuBLAS's; the one exception is the operand copy of a matmul, see ``storage``), the
process group's own buffers beyond the reduce-scatter's (gloo gathers into a temporary
buffer on its thread), and garbage awaiting Python's cycle collector. The step assumed is
``loss_fn(model(*inputs)).backward(); optimizer.step(); optimizer.zero_grad()``, with the
output not kept past the loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_lite.addons.activation_checkpointing import apply_activation_checkpointing
from fsdp_lite.addons.offload import CPUOffload, SSDOffload
from fsdp_lite.build import from_torch_fsdp
from fsdp_lite.build.wrap import Policy
from fsdp_lite.core import dtensors
from fsdp_lite.core.nested import tensors_in
from fsdp_lite.core.policies import MixedPrecision, PrefetchPolicy, resolve_optimizer_params
from fsdp_lite.fsdp import FSDPModule
from fsdp_lite.planner.layout import UnitLayout, layout_units, own_whole_params
from fsdp_lite.planner.replay import TERMS, ReplayConfig, replay
from fsdp_lite.planner.trace import StepTrace, trace_step

_MiB = 2**20
_OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's predicted peak over a steady-state training step.

    ``peak_bytes``: tensor bytes on the compute device at the peak (see the module doc).
    ``breakdown``: the terms at that point (bytes; they sum to ``peak_bytes``).
    ``phase``: where in the step the peak falls. ``host_bytes``: offloaded state in host
    memory when the compute device is not the CPU (else 0: it is in ``peak_bytes``).
    """

    peak_bytes: int
    breakdown: dict[str, int]
    phase: str
    device: str
    world_size: int
    host_bytes: int = 0
    # whole_params: the estimate is the rank owning the most bytes; its owned bytes over
    # the mean (1.0 for the default layout, where every shard is 1/W).
    owned_imbalance: float = 1.0

    def __str__(self) -> str:
        lines = [
            f"peak {self.peak_bytes / _MiB:.2f} MiB on {self.device} (W={self.world_size}) "
            f"at: {self.phase}"
        ]
        if self.owned_imbalance != 1.0:
            lines[0] += f" (the rank owning the most: {self.owned_imbalance:.2f}x the mean)"
        lines += [f"  {k:<24}{v / _MiB:10.2f} MiB" for k, v in self.breakdown.items() if v]
        if self.host_bytes:
            lines.append(f"  host (offloaded state)  {self.host_bytes / _MiB:10.2f} MiB")
        return "\n".join(lines)


@dataclass(frozen=True)
class Plan:
    """The fastest settings found that fit the budget, and their estimate.

    ``fsdp_kwargs()`` are the ``FSDPModule`` arguments; with ``activation_checkpointing``
    apply ``fsdp_lite.apply_activation_checkpointing`` to the same modules first, or call
    ``wrap(model)``, which does both.
    """

    reshard_after_forward: bool | None
    activation_checkpointing: bool | Policy  # True: each unit of auto_wrap_policy
    offload: CPUOffload | None
    prefetch: PrefetchPolicy | None
    estimate: MemoryEstimate
    budget_bytes: int
    auto_wrap_policy: Policy | None = None
    mixed_precision: MixedPrecision | None = None
    optimizer_params: str = "flat"
    # How to run the micro-batches before a step's last (None: one micro-batch a step):
    # "keep" -- set_requires_gradient_sync(False) and set_reshard_after_backward(False), each
    # unit gathered once a step; "no_sync" -- set_requires_gradient_sync(False) (or
    # no_sync()) alone; "sync" -- every micro-batch reduce-scattered. See grad_accumulation.
    grad_accumulation: str | None = None

    def fsdp_kwargs(self) -> dict[str, Any]:
        return {
            "auto_wrap_policy": self.auto_wrap_policy,
            "mixed_precision": self.mixed_precision,
            "optimizer_params": self.optimizer_params,
            "reshard_after_forward": self.reshard_after_forward,
            "prefetch": self.prefetch,
            "offload": self.offload,
        }

    def wrap(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        """``FSDPModule(model, **fsdp_kwargs(), **kwargs)``, each unit's module checkpointed
        first when the plan says so."""
        ac = self.activation_checkpointing
        if ac is True:
            apply_activation_checkpointing(model, self.auto_wrap_policy)
        elif ac:
            apply_activation_checkpointing(model, ac)
        return FSDPModule(model, **self.fsdp_kwargs(), **kwargs)


def default_loss(output: Any) -> torch.Tensor:
    """The sum of every floating-point tensor in ``output`` (nested tuples, lists, dicts,
    dataclasses such as Hugging Face's ``ModelOutput``)."""
    parts = [t.sum() for t in tensors_in(output) if t.is_floating_point()]
    if not parts:
        raise ValueError(
            "estimate_memory: the model's output holds no floating-point tensor; pass loss_fn"
        )
    return functools.reduce(torch.add, parts)


def estimate_memory(
    model: nn.Module,
    example_inputs: tuple | torch.Tensor,
    world_size: int,
    *,
    auto_wrap_policy: Policy | None = None,
    mixed_precision: MixedPrecision | None = None,
    reshard_after_forward: bool | None = None,
    activation_checkpointing: bool | Policy = False,
    offload: CPUOffload | None = None,
    optimizer: str | float = "adamw",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    prefetch: PrefetchPolicy | None = PrefetchPolicy(),  # noqa: B008 - frozen, as FSDPModule's
    device: torch.device | str | None = None,
    backend: str | None = None,
    optimizer_params: str | None = None,
    whole_params: bool = False,
    grad_accumulation: str | None = None,
) -> MemoryEstimate:
    """Predict one rank's peak tensor memory over a steady-state training step.

    Args:
        model: the model as it would be passed to ``FSDPModule`` (unwrapped; on the meta
            device, on CPU, anywhere: its tensors are neither read nor copied).
        example_inputs: one rank's micro-batch: the positional arguments (a tuple) or a tensor.
        world_size: W, the ranks parameters are sharded over.
        auto_wrap_policy, mixed_precision, reshard_after_forward, offload, prefetch: as
            ``FSDPModule`` takes them (``offload``: ``CPUOffload`` or ``None``).
        activation_checkpointing: ``True`` checkpoints each unit the auto-wrap policy makes
            (as ``apply_activation_checkpointing(model, auto_wrap_policy)``); a policy picks
            the modules to checkpoint.
        optimizer: ``"adamw"``/``"adam"`` (two states per trainable element), ``"sgd"``
            (none), ``"sgd_momentum"`` (one), or the number of states per element (in the
            master dtype: fp32, fp64 for fp64 parameters).
        loss_fn: ``loss_fn(output) -> scalar``; default: the sum of the output's floating
            tensors (``default_loss``).
        device: the compute device planned for; default: CUDA if available, else the CPU.
        backend: the process group's backend: ``"nccl"``/``"gloo"`` keep a buffer for the
            reduce-scatter in flight, ``"fake"`` (torch's fake process group, for tests)
            keeps nothing. Default: nccl on CUDA, gloo on the CPU.
        optimizer_params, whole_params: as ``FSDPModule`` takes them; with ``"whole"`` the
            estimate is for the rank that owns the most bytes (``owned_imbalance``).
        grad_accumulation: ``None``: one micro-batch a step (``example_inputs``). Else a
            step of several such micro-batches, the peak of any, those before the last
            run as: ``"sync"`` (each reduce-scattered: the shard grads held across),
            ``"no_sync"`` (``set_requires_gradient_sync(False)`` or ``no_sync()``: an
            unsharded fp32 gradient sum per trainable flat param, ``grad_accumulators``),
            ``"keep"`` (that and ``set_reshard_after_backward(False)``: every unit's full
            parameters held from the step's first forward to its last backward).
    """
    from_torch_fsdp.check_options(
        auto_wrap_policy, mixed_precision, offload, prefetch, reshard_after_forward
    )
    view = resolve_optimizer_params(optimizer_params, whole_params=whole_params)
    planner = _Planner(model, example_inputs, world_size, auto_wrap_policy, mixed_precision,
                       optimizer, loss_fn, device, backend, view)  # fmt: skip
    return planner.estimate(
        activation_checkpointing, reshard_after_forward, offload, prefetch, grad_accumulation
    )


def plan(
    model: nn.Module,
    example_inputs: tuple | torch.Tensor,
    world_size: int,
    budget_bytes: int,
    **kwargs: Any,
) -> Plan:
    """The fastest settings whose estimate fits ``budget_bytes`` (keyword arguments as for
    ``estimate_memory``; a searched setting passed explicitly is held fixed).

    Tried from fastest to slowest: no CPU offload before offload, no activation
    checkpointing before checkpointing, then prefetching two units, one, none (``None``,
    which also stops keeping the last block's parameters from forward to backward), then,
    with ``grad_accumulation="auto"`` (a step of several micro-batches), keeping every
    unit gathered across them before gathering each time (``"keep"``, ``"no_sync"``,
    ``"sync"``: see ``estimate_memory``; the plan's ``grad_accumulation`` says which),
    then ``reshard_after_forward`` False (no all-gather in backward), None (the default),
    True. Raises ``ValueError`` naming the smallest estimate and what to change if nothing
    fits.
    """
    if kwargs.get("grad_accumulation") == "auto":
        del kwargs["grad_accumulation"]
    else:
        kwargs.setdefault("grad_accumulation", None)
    fixed = {k: kwargs.pop(k) for k in _SEARCHED if k in kwargs}
    planner = _Planner(
        model,
        example_inputs,
        world_size,
        kwargs.pop("auto_wrap_policy", None),
        kwargs.pop("mixed_precision", None),
        kwargs.pop("optimizer", "adamw"),
        kwargs.pop("loss_fn", None),
        kwargs.pop("device", None),
        kwargs.pop("backend", None),
        resolve_optimizer_params(
            kwargs.pop("optimizer_params", None), whole_params=kwargs.pop("whole_params", False)
        ),
    )
    if kwargs:
        raise TypeError(f"plan() got unexpected keyword arguments {sorted(kwargs)}")
    smallest: tuple[MemoryEstimate, dict[str, Any]] | None = None
    for settings in _candidates(fixed, planner):
        est = planner.estimate(**settings)
        if est.peak_bytes <= budget_bytes:
            return Plan(
                settings["reshard_after_forward"], settings["activation_checkpointing"],
                settings["offload"], settings["prefetch"], est, budget_bytes, planner.policy,
                planner.mp, planner.optimizer_params, settings["grad_accumulation"],
            )  # fmt: skip
        if smallest is None or est.peak_bytes < smallest[0].peak_bytes:
            smallest = (est, settings)
    raise ValueError(_nothing_fits(budget_bytes, smallest, planner))


_SEARCHED = (
    "offload", "activation_checkpointing", "prefetch", "grad_accumulation", "reshard_after_forward",
)  # fmt: skip


def _candidates(fixed: dict[str, Any], planner: _Planner) -> Iterator[dict[str, Any]]:
    """Settings from fastest to slowest (see ``plan``). CPU offload is not tried when the
    compute device is the CPU (it moves nothing), checkpointing not without units."""
    options = {
        "offload": [None, CPUOffload()] if planner.device.type != "cpu" else [None],
        "activation_checkpointing": [False, True] if planner.can_checkpoint() else [False],
        "prefetch": [PrefetchPolicy(), PrefetchPolicy(max_in_flight=1), None],
        "grad_accumulation": ["keep", "no_sync", "sync"],
        "reshard_after_forward": [False, None, True],
    }
    for key, value in fixed.items():
        options[key] = [value]
    for offload in options["offload"]:
        for ac in options["activation_checkpointing"]:
            for prefetch in options["prefetch"]:
                for accumulation in options["grad_accumulation"]:
                    for raf in options["reshard_after_forward"]:
                        yield {
                            "activation_checkpointing": ac,
                            "reshard_after_forward": raf,
                            "offload": offload,
                            "prefetch": prefetch,
                            "grad_accumulation": accumulation,
                        }


def _nothing_fits(
    budget: int, smallest: tuple[MemoryEstimate, dict[str, Any]], planner: _Planner
) -> str:
    est, settings = smallest
    shown = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    top = sorted(est.breakdown.items(), key=lambda kv: -kv[1])[:3]
    terms = ", ".join(f"{k} {v / _MiB:.1f} MiB" for k, v in top)
    advice = []
    keys = {k for k, _ in top}
    if keys & {"activations", "backward_temporaries"}:
        advice.append("a smaller micro-batch (activations grow with it)")
    if keys & {"shards", "optimizer_state", "gradients"}:
        advice.append(f"more ranks than W={est.world_size} (sharded state shrinks as 1/W)")
    if keys & {"gathered_units", "full_gradients", "reduce_scatter_buffers"}:
        largest = max(u.full_bytes for u in planner.units)
        advice.append(
            f"smaller units (a finer auto_wrap_policy: the largest unit gathers "
            f"{largest / _MiB:.1f} MiB)"
        )
    if "grad_accumulators" in keys:
        advice.append("syncing every micro-batch (grad_accumulation='sync': no fp32 sums)")
    if planner.mp is None:
        advice.append("bf16 mixed precision (MixedPrecision(param_dtype=torch.bfloat16))")
    if not advice:
        advice.append("a larger budget")
    return (
        f"fsdp_lite.plan: no setting fits the budget of {budget / _MiB:.1f} MiB per rank; the "
        f"smallest estimate is {est.peak_bytes / _MiB:.1f} MiB ({shown}), at {est.phase}, "
        f"mostly {terms}. To fit, try " + "; or ".join(advice)
    )


class _Planner:
    """What estimates of one model and micro-batch share: the layout and the traces."""

    def __init__(
        self,
        model: nn.Module,
        example_inputs: tuple | torch.Tensor,
        world_size: int,
        policy: Policy | None,
        mp: MixedPrecision | None,
        optimizer: str | float,
        loss_fn: Callable[[Any], torch.Tensor] | None,
        device: torch.device | str | None,
        backend: str | None,
        optimizer_params: str = "flat",
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if mp is not None and not isinstance(mp, MixedPrecision):
            raise TypeError(f"mixed_precision must be fsdp_lite.MixedPrecision, got {mp!r}")
        tp = next((n for n, p in model.named_parameters() if dtensors.layout_of(p)), None)
        if tp is not None:
            raise NotImplementedError(
                f"the planner does not model tensor, sequence or expert parallelism yet: "
                f"parameter '{tp}' is a DTensor. Estimate the model before parallelize_module "
                "(its parameters, gradients and optimizer state then overcount by the TP "
                "degree of each sharded parameter)"
            )
        self.model, self.world_size, self.policy, self.mp = model, world_size, policy, mp
        self.inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        self.states = _optimizer_states(optimizer)
        self.sgd_like = not isinstance(optimizer, str) or optimizer.lower().startswith("sgd")
        self.loss_fn = loss_fn or default_loss
        self.device = _device(device)
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        whole_params = optimizer_params == "whole"
        self.comm_keeps = _comm_keeps(backend, world_size, whole_params)
        self.units: list[UnitLayout] = layout_units(model, world_size, policy, mp)
        self.optimizer_params = optimizer_params
        self.imbalance = own_whole_params(model, self.units, world_size) if whole_params else 1.0
        self._traces: dict[Any, StepTrace] = {}

    def can_checkpoint(self) -> bool:
        return len(self.units) > 1

    def estimate(
        self,
        activation_checkpointing: bool | Policy,
        reshard_after_forward: bool | None,
        offload: CPUOffload | None,
        prefetch: PrefetchPolicy | None,
        grad_accumulation: str | None = None,
    ) -> MemoryEstimate:
        if isinstance(offload, SSDOffload):
            raise ValueError("estimate_memory models CPUOffload only, not SSDOffload")
        if prefetch is not None and not isinstance(prefetch, PrefetchPolicy):
            raise TypeError(f"prefetch must be fsdp_lite.PrefetchPolicy or None, got {prefetch!r}")
        trace = self._trace(activation_checkpointing)
        to_host = offload is not None and self.device.type != "cpu"
        cfg = ReplayConfig(
            reshard_after_forward=reshard_after_forward,
            prefetch=prefetch,
            reduce_dtype=self.mp.effective_reduce_dtype if self.mp is not None else None,
            offload_to_host=to_host,
            optimizer_states=self.states,
            optimizer_temporaries=self._optimizer_temporaries(to_host),
            step_tensors=not self.sgd_like and self.device.type == "cpu",
            comm_keeps=self.comm_keeps,
            accumulation=grad_accumulation,
        )
        peak = replay(self.units, trace, cfg)
        breakdown = {k: peak.breakdown.get(k, 0) for k in TERMS}
        return MemoryEstimate(
            peak.bytes, breakdown, peak.phase, str(self.device), self.world_size, peak.host_bytes,
            self.imbalance,
        )  # fmt: skip

    def _optimizer_temporaries(self, to_host: bool) -> str:
        if self.sgd_like:
            return "none"
        return "foreach" if self.device.type == "cuda" and not to_host else "per_tensor"

    def _trace(self, activation_checkpointing: bool | Policy) -> StepTrace:
        checkpointed = self._checkpointed(activation_checkpointing)
        key = tuple(id(m) for m in checkpointed)
        if key not in self._traces:
            self._traces[key] = trace_step(
                self.model,
                self.inputs,
                self.units,
                device=self.device,
                mixed_precision=self.mp,
                checkpointed=checkpointed,
                loss_fn=self.loss_fn,
            )
        return self._traces[key]

    def _checkpointed(self, ac: bool | Policy) -> list[nn.Module]:
        """The modules ``apply_activation_checkpointing`` would wrap."""
        if ac is False or ac is None:
            return []
        if ac is True:
            if not self.can_checkpoint():
                raise ValueError(
                    "activation_checkpointing=True checkpoints each unit the auto_wrap_policy "
                    "makes, and it makes none: pass an auto_wrap_policy, or a policy as "
                    "activation_checkpointing"
                )
            picked = [u.module for u in self.units[1:]]
            inner = {id(m) for p in picked for m in p.modules() if m is not p}
            return [m for m in picked if id(m) not in inner]  # the outermost, as apply_... does
        picked: list[nn.Module] = []
        seen: set[int] = set()

        def visit(module: nn.Module) -> None:
            for child in module.children():
                if id(child) in seen:
                    continue
                seen.add(id(child))
                if ac(child):
                    picked.append(child)
                else:
                    visit(child)

        visit(self.model)
        return picked


def _optimizer_states(optimizer: str | float) -> float:
    if isinstance(optimizer, str):
        if optimizer.lower() not in _OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {sorted(_OPTIMIZERS)} or a number of states per "
                f"element, got {optimizer!r}"
            )
        return float(_OPTIMIZERS[optimizer.lower()])
    if isinstance(optimizer, bool) or not isinstance(optimizer, int | float) or optimizer < 0:
        raise ValueError(f"optimizer states per element must be a number >= 0, got {optimizer!r}")
    return float(optimizer)


def _comm_keeps(backend: str, world_size: int, whole_params: bool) -> str:
    if world_size == 1:
        return "none"  # collectives.py skips communication at one rank
    if backend == "fake":  # keeps nothing, but per-rank sizes are all-reduced in place
        return "input" if whole_params else "none"
    if backend in ("nccl", "gloo"):
        return "input"  # NCCL stashes it; gloo all-reduces it in place (collectives.py)
    raise ValueError(f"backend must be 'nccl', 'gloo' or 'fake', got {backend!r}")


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"estimate_memory plans for cpu or cuda devices, got {device}")
    if device.type == "cuda" and torch.version.cuda is None:
        raise ValueError(
            "estimate_memory: planning for CUDA traces the step with CUDA's kernels, which this "
            "CPU-only build of torch does not have; run it where a CUDA build is installed, or "
            "pass device='cpu' to plan a CPU run"
        )
    return device


__all__ = ["MemoryEstimate", "Plan", "default_loss", "estimate_memory", "plan"]
