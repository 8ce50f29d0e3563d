"""Train an FSDPModule beside a single-process reference and compare them.

The reference is a plain copy of the same model with the same seed, trained on the
*global* batch (every rank's data); each rank feeds FSDP only its own slice. Losses
are compared every step, parameters at the end. Every rank runs the reference itself,
so nothing but the model under test is communicated.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lite.addons.state_dict import full_grads
from fsdp_lite.fsdp import FSDPModule

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Tolerance:
    loss_rtol: float
    param_atol: float | None = None  # max |p_fsdp - p_ref| (fp32)
    update_rtol: float | None = None  # ||Δ_fsdp - Δ_ref|| / ||Δ_ref|| (mixed precision)
    grad_rtol: float = 1e-4  # per parameter ||g_fsdp - g_ref|| / ||g_ref||
    norm_rtol: float = 1e-4  # clip_grad_norm_'s total norm


# [Note: tolerances are measured, not guessed]
# Each figure is a margin of 2.5-4x over the worst error the *correct* code showed
# (measured 2026-11-25 over every compare_training run of test_equivalence, test_features,
# test_checkpointing, test_offload, test_prefetch, test_deferred_init, test_hybrid,
# test_hf_models and test_randomized, W = 1-4). A tolerance must stay below the errors
# the bugs it guards against make: test_mutations proves that a divisor of W+1 at W=3
# (a gradient error of 0.25), a dropped or missing division and a lost gradient fail.
# A test whose reference rounds differently (a convolution net against an fp32
# reference) takes its own, explicit tolerance; never loosen these for one test.
FP32 = Tolerance(loss_rtol=1e-5, param_atol=1e-5, grad_rtol=1e-4)
# Mixed precision against a reference that computes in fp32 (the GPT-like models of
# cases.py and hf_cases.py). Worst measured, bf16: grad 0.0308 (clip, W=3), update
# 0.0319 (hybrid W=4), loss 7.43e-5 (HF llama), clip norm 1.14e-3; fp16: grad 0.0106,
# update 0.0094, loss 2.12e-5 (GPT, W=2-3); no fp16 test clips (norm_rtol as before).
BF16 = Tolerance(loss_rtol=2e-4, update_rtol=0.08, grad_rtol=0.08, norm_rtol=3e-3)
FP16 = Tolerance(loss_rtol=6e-5, update_rtol=0.03, grad_rtol=0.03, norm_rtol=1e-2)
# Mixed precision against a reference that rounds where fsdp_lite does (it computes in
# param_dtype and averages each rank's rounded gradient in fp32: random_models'
# build_reference). Worst measured over 425 random cases, bf16: grad 0.0050, update
# 1.5e-4, loss 1.41e-7; fp16: grad 3.8e-4, update 7.7e-5, loss 1.41e-7; nothing clips
# (norm_rtol: a norm errs by at most the gradients' error).
BF16_ROUNDED = Tolerance(loss_rtol=5e-7, update_rtol=5e-4, grad_rtol=0.015, norm_rtol=0.015)
FP16_ROUNDED = Tolerance(loss_rtol=5e-7, update_rtol=3e-4, grad_rtol=1.5e-3, norm_rtol=1.5e-3)


@dataclass
class Run:
    """One training comparison. ``batch(step)`` returns the global batch (same on every rank)."""

    name: str
    make_model: Callable[[], nn.Module]
    batch: Callable[[int], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    wrap: Callable[[nn.Module], FSDPModule]
    tol: Tolerance = FP32
    steps: int = 5
    lr: float = 1e-3
    split_reference: bool = False  # reference runs each rank's slice separately (BatchNorm)
    # Every rank and every reference slice starts each micro-step from the same RNG
    # state, so dropout masks agree (implies split_reference).
    replay_rng: bool = False
    accumulate: int = 1  # micro-batches per step; all but the last under no_sync
    # False: every micro-batch reduce-scatters, so shard grads accumulate across backwards.
    no_sync: bool = True
    clip: float | None = None
    clip_norm_type: float = 2.0
    # Called with (wrapped, reference) once both exist, before the first training step:
    # e.g. an inference forward as the wrapped model's very first call.
    before_training: Callable[[nn.Module, nn.Module], None] | None = None
    between_steps: Callable[[nn.Module, nn.Module, int], None] | None = None
    compare_buffers: bool = True
    # fp16 loss scaling: fsdp_lite.ShardedGradScaler beside torch.amp.GradScaler on the
    # reference; the same steps must be skipped and the scales stay equal.
    scaler: bool = False
    # The reference and every batch live here (e.g. "cuda:0"); the wrapped model lives
    # where ``wrap`` puts it. None: the CPU.
    device: str | None = None
    # The optimizers of a model (called for the wrapped model and for the reference, so
    # per-parameter groups built from named_parameters() must agree); default: one AdamW.
    optimizers: Callable[[nn.Module], list[torch.optim.Optimizer]] | None = None
    # (this rank's slice, number of slices) of the global batch: under tensor parallelism
    # the dp coordinate (the ranks of a TP group share a slice). None: (rank, world).
    data_slice: Callable[[], tuple[int, int]] | None = None
    results: dict[str, Any] = field(default_factory=dict)


def _slice(batch: Batch, index: int, parts: int) -> Batch:
    return tuple(t.chunk(parts)[index] for t in batch)  # type: ignore[return-value]


def _reference_step(run: Run, ref: nn.Module, micro: Batch, world: int) -> torch.Tensor:
    if not (run.split_reference or run.replay_rng):
        return run.loss(ref, micro)
    rng = _rng_state()
    total = 0.0
    for r in range(world):
        if run.replay_rng:
            _set_rng_state(rng)
        total = total + run.loss(ref, _slice(micro, r, world))
    if run.replay_rng:
        _set_rng_state(rng)  # the FSDP rank's forward draws the same masks
    return total / world


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The CPU generator's state, and every CUDA device's where CUDA is initialized."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _mean_over_ranks(x: torch.Tensor) -> float:
    x = x.detach().float().clone()
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()


def compare_runs(runs: list[Run]) -> dict[str, str | None]:
    """``compare_training`` for every run, each reported by its name (``run_subtests``):
    a run that fails does not hide the state of the others."""
    from fsdp_lite.testing.subtests import run_subtests

    return run_subtests((run.name, functools.partial(compare_training, run)) for run in runs)


def compare_training(run: Run) -> None:
    """Train FSDP beside the reference; raise AssertionError naming the run on a mismatch."""
    rank, world = run.data_slice() if run.data_slice else (dist.get_rank(), dist.get_world_size())
    torch.manual_seed(1234)
    ref = run.make_model()
    if run.device is not None:
        ref.to(run.device)
    initial = {k: v.detach().cpu().clone() for k, v in ref.state_dict().items()}
    model = run.wrap(copy.deepcopy(ref))
    make = run.optimizers or functools.partial(_adamw, lr=run.lr)
    ref_opts, opts = make(ref), make(model)
    scalers = _Scalers(run.scaler, opts, ref_opts)
    if run.before_training is not None:
        run.before_training(model, ref)
    for step in range(run.steps):
        batch = run.batch(step)
        if run.device is not None:
            batch = tuple(t.to(run.device) for t in batch)
        ref_loss = fsdp_loss = 0.0
        for m in range(run.accumulate):
            micro = _slice(batch, m, run.accumulate)
            loss = _reference_step(run, ref, micro, world) / run.accumulate
            scalers.backward(loss, reference=True)
            ref_loss += loss.item()
            local = _slice(micro, rank, world)
            sync = m == run.accumulate - 1 or not run.no_sync
            ctx = model.no_sync() if not sync else _nullcontext()
            with ctx:
                loss = run.loss(model, local) / run.accumulate
                scalers.backward(loss, reference=False)
            fsdp_loss += _mean_over_ranks(loss)
        _check_close(run, f"step {step} loss", fsdp_loss, ref_loss, run.tol.loss_rtol)
        if not scalers.unscale(run, step):
            continue  # both skip this step (an overflow), both lower the scale
        if run.clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(
                ref.parameters(), run.clip, run.clip_norm_type
            )
            norm = model.clip_grad_norm_(run.clip, run.clip_norm_type)
            _check_close(
                run,
                f"step {step} grad norm",
                norm.item(),
                ref_norm.item(),
                run.tol.norm_rtol,
            )
        _check_grads(run, model, ref, step)
        scalers.step()
        for o in (*ref_opts, *opts):
            o.zero_grad()
        if run.between_steps is not None:
            run.between_steps(model, ref, step)
    _check_params(run, model, ref, initial, world)


class _Scalers:
    """The step's optimizers, with or without loss scaling on both sides."""

    def __init__(
        self, on: bool, opts: list[torch.optim.Optimizer], ref_opts: list[torch.optim.Optimizer]
    ) -> None:
        from fsdp_lite.addons.grad_scaler import ShardedGradScaler

        self.opts, self.ref_opts = opts, ref_opts
        if on and len(opts) != 1:
            raise ValueError("loss scaling is compared with one optimizer")
        self.opt, self.ref_opt = opts[0], ref_opts[0]
        # The scale jumps x64 after every step taken and /64 after an overflow: from 2**12,
        # a small model steps, overflows at 2**18 (skipped), steps again: a short run both
        # skips and steps.
        kw = {"init_scale": 2.0**12, "growth_factor": 64.0, "backoff_factor": 1 / 64,
              "growth_interval": 1}  # fmt: skip
        self.fsdp = ShardedGradScaler("cpu", **kw) if on else None
        self.ref = torch.amp.GradScaler("cpu", **kw) if on else None

    def backward(self, loss: torch.Tensor, reference: bool) -> None:
        scaler = self.ref if reference else self.fsdp
        (loss if scaler is None else scaler.scale(loss)).backward()

    def unscale(self, run: Run, step: int) -> bool:
        """Unscale both; False (after stepping both scalers) when both found an overflow."""
        if self.fsdp is None:
            return True
        self.fsdp.unscale_(self.opt)
        self.ref.unscale_(self.ref_opt)
        found = [
            sum(v.item() for v in s._found_inf_per_device(o).values()) > 0
            for s, o in ((self.fsdp, self.opt), (self.ref, self.ref_opt))
        ]
        if found[0] != found[1]:
            raise AssertionError(
                f"[{run.name}] step {step}: overflow found by fsdp {found[0]}, reference {found[1]}"
            )
        if not found[0]:
            return True
        self.step()
        self.opt.zero_grad()
        self.ref_opt.zero_grad()
        return False

    def step(self) -> None:
        if self.fsdp is None:
            for o in (*self.ref_opts, *self.opts):
                o.step()
            return
        self.ref.step(self.ref_opt)
        self.fsdp.step(self.opt)
        self.ref.update()
        self.fsdp.update()
        if self.ref.get_scale() != self.fsdp.get_scale():
            raise AssertionError(f"scale {self.fsdp.get_scale()} vs {self.ref.get_scale()}")


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _adamw(model: nn.Module, lr: float) -> list[torch.optim.Optimizer]:
    # eps=1e-6, not 1e-8: some gradients are zero in exact arithmetic (the key bias of
    # attention, anything a norm cancels) and rounding noise there would be normalized
    # by Adam into lr-sized steps that differ between any two summation orders.
    return [torch.optim.AdamW(_trainable(model), lr=lr, weight_decay=0.1, eps=1e-6)]


def _check_grads(run: Run, model: FSDPModule, ref: nn.Module, step: int) -> None:
    """Unsharded FSDP gradients equal the reference's: catches scale errors Adam would hide.
    Frozen shards get no ``.grad`` at all."""
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    if frozen:
        raise AssertionError(f"[{run.name}] step {step}: frozen shards got a .grad: {frozen}")
    got = full_grads(model)
    for name, p in ref.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            if name in got:
                raise AssertionError(f"[{run.name}] frozen parameter {name} got a gradient")
            continue
        want = (p.grad if p.grad is not None else torch.zeros_like(p)).to(got[name].device)
        err = ((got[name] - want).norm() / want.norm().clamp_min(1e-12)).item()
        limit = run.tol.grad_rtol
        if err > limit and (got[name] - want).abs().max() > 1e-7:
            raise AssertionError(
                f"[{run.name}] step {step} grad of {name}: relative error {err:.3g} > {limit}"
            )
        run.results["max_grad_rel_err"] = max(run.results.get("max_grad_rel_err", 0.0), err)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _check_close(run: Run, what: str, got: float, want: float, rtol: float) -> None:
    if abs(got - want) > rtol * max(abs(want), 1e-8):
        raise AssertionError(
            f"[{run.name}] {what}: fsdp {got:.8g} vs reference {want:.8g} (rtol {rtol})"
        )


def _check_params(run: Run, model: FSDPModule, ref: nn.Module, initial: dict, world: int) -> None:
    got = model.state_dict()
    want = {k: v.cpu() for k, v in ref.state_dict().items()}
    if list(got) != list(want):
        raise AssertionError(f"[{run.name}] state dict keys differ: {list(got)} vs {list(want)}")
    params = {n for n, _ in ref.named_parameters(remove_duplicate=False)}
    keys = [k for k in want if k in params or (run.compare_buffers and world == 1)]
    if run.tol.param_atol is not None:
        worst = max(keys, key=lambda k: (got[k].float() - want[k].float()).abs().max().item())
        diff = (got[worst].float() - want[worst].float()).abs().max().item()
        run.results["max_param_diff"] = diff
        if diff > run.tol.param_atol:
            raise AssertionError(f"[{run.name}] parameter {worst} differs by {diff:.3g}")
    if run.tol.update_rtol is not None:
        keys = [k for k in keys if k in params]
        d_got = torch.cat([(got[k] - initial[k]).flatten().float() for k in keys])
        d_want = torch.cat([(want[k] - initial[k]).flatten().float() for k in keys])
        rel = ((d_got - d_want).norm() / d_want.norm()).item()
        run.results["update_rel_err"] = rel
        if not d_want.norm() > 0 or rel > run.tol.update_rtol:
            raise AssertionError(f"[{run.name}] parameter updates differ: relative error {rel:.3g}")
