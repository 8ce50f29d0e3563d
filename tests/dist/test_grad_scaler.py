"""fp16 loss scaling over shards: with ShardedGradScaler two ranks skip the same steps as a
single-process torch.amp.GradScaler reference on the global batch (also when only one
rank's shard overflows), keep equal scales after every step, and end with its parameters;
a stock GradScaler over multi-rank shards warns, and its ranks' scales drift apart.

[Note: why the tolerances are tight]
The reference rounds as fsdp_lite does: fp32 masters cast to fp16 for compute, each rank's
half of the batch run separately in fp16 (the same kernels on the same shapes as the
rank), the two fp16 gradients summed in fp32 and halved (the reduce-scatter's fp32 sum
of two values and its division by W=2, both exact to the same bits), then the same
unscale and AdamW update elementwise. Nothing is reassociated, so losses and parameters
agree to fp32 rounding of the loss average (1e-6) unless the clip's norm is involved,
whose fp32 sum order differs (1e-5). A step taken on one side and skipped on the other
moves parameters by about lr = 1e-2.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import fsdp_lite
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.subtests import agree, assert_subtests_passed, run_subtests

WORLD = 2
STEPS = 10
INJECT_STEP = 3  # after backward, rank 1's first shard grad gets an inf: one rank overflows
BLOWUP_STEP = 6  # rank 0's half of the batch is huge: a genuine fp16 overflow in backward
SKIPPED = [INJECT_STEP, BLOWUP_STEP]
LR = 1e-2
CLIP = 0.05  # below every clean step's norm, so clipping acts
FP16 = fsdp_lite.MixedPrecision(param_dtype=torch.float16)
MESSAGE = "Use fsdp_lite.ShardedGradScaler"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 17), nn.ReLU(), nn.Linear(17, 9), nn.ReLU(), nn.Linear(9, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch, 4 rows per rank; rank r's half is ``chunk(WORLD)[r]``."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    if step == BLOWUP_STEP:
        x[:4] *= 1e3
    return x, y


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).square().mean()


def _scaler(cls: type[torch.amp.GradScaler]) -> torch.amp.GradScaler:
    return cls("cpu", init_scale=2.0**10, growth_interval=3)  # grows at clean steps 2 and 9


def _scaler_on_default_device(device: str, **kwargs) -> torch.amp.GradScaler:
    """``ShardedGradScaler()`` with no device: the ranks' (CPU here), never a disabled
    scaler on an absent "cuda" (torch's default)."""
    scaler = fsdp_lite.ShardedGradScaler(**kwargs)
    assert scaler.is_enabled() and scaler._device == device, (scaler._device, device)
    return scaler


def _optimizer(params, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=1e-6, fused=fused)


@dataclass
class Trace:
    losses: list[float] = field(default_factory=list)  # global-batch loss before each step
    scales: list[float] = field(default_factory=list)  # after each update()
    norms: list[float] = field(default_factory=list)  # clip's total norm, clean steps
    skipped: list[int] = field(default_factory=list)  # steps the optimizer did not take
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # full, at the end
    scaler_state: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # about GradScaler, during scaler.step


def _finish_step(trace, step, scaler, opt, first, clip_norm, params) -> None:
    """Unscale and clip (if ``clip_norm`` does it), step, update; record what happened."""
    before = _adam_steps(opt, first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norm = None
        if clip_norm is not None:
            scaler.unscale_(opt)
            norm = clip_norm()
        scaler.step(opt)
    trace.warnings += [str(w.message) for w in caught if "GradScaler" in str(w.message)]
    scaler.update()
    opt.zero_grad(set_to_none=True)
    trace.scales.append(scaler.get_scale())
    if _adam_steps(opt, first) == before:
        trace.skipped.append(step)
    elif norm is not None:
        trace.norms.append(float(norm))


def _adam_steps(opt: torch.optim.Optimizer, param: torch.Tensor) -> int:
    return int(opt.state[param]["step"]) if param in opt.state else 0


def _train_sharded(scaler_cls, *, fused: bool, clip: bool, steps: int = STEPS) -> Trace:
    rank = dist.get_rank()
    model = fsdp_lite.FSDPModule(
        _model(), auto_wrap_policy=fsdp_lite.wrap.by_type(nn.Linear), mixed_precision=FP16
    )
    params = list(model.parameters())
    opt, scaler, trace = _optimizer(params, fused), _scaler(scaler_cls), Trace()
    clip_norm = functools.partial(model.clip_grad_norm_, CLIP) if clip else None
    for step in range(steps):
        x, y = (t.chunk(WORLD)[rank] for t in _batch(step))
        loss = _loss(model(x), y)
        scaler.scale(loss).backward()
        if step == INJECT_STEP and rank == 1:
            params[0].grad[0] = float("inf")
        total = loss.detach().double()
        dist.all_reduce(total)
        trace.losses.append(total.item() / WORLD)
        _finish_step(trace, step, scaler, opt, params[0], clip_norm, params)
    trace.params = model.state_dict()
    trace.scaler_state = scaler.state_dict()
    return trace


def _train_reference(*, fused: bool, clip: bool) -> Trace:
    """One process, the global batch: fp32 masters, an fp16 copy for compute, each rank's
    half run separately and the fp16 grads averaged in fp32, stock GradScaler."""
    master = _model()
    half = _model().half()
    params = list(master.parameters())
    opt, scaler, trace = _optimizer(params, fused), _scaler(torch.amp.GradScaler), Trace()
    clip_norm = (lambda: nn.utils.clip_grad_norm_(params, CLIP)) if clip else None
    for step in range(STEPS):
        with torch.no_grad():
            for h, m in zip(half.parameters(), params, strict=True):
                h.copy_(m)  # rounds to fp16 as the shard's cast before the gather does
        grads = [torch.zeros_like(p) for p in params]
        losses = []
        for x, y in zip(*(t.chunk(WORLD) for t in _batch(step)), strict=True):
            half.zero_grad(set_to_none=True)
            loss = _loss(half(x.half()), y)
            scaler.scale(loss).backward()
            losses.append(loss.item())
            for g, h in zip(grads, half.parameters(), strict=True):
                g += h.grad.float()
        for p, g in zip(params, grads, strict=True):
            p.grad = g / WORLD
        if step == INJECT_STEP:
            params[0].grad.view(-1)[0] = float("inf")
        trace.losses.append(sum(losses) / WORLD)
        _finish_step(trace, step, scaler, opt, params[0], clip_norm, params)
    trace.params = master.state_dict()
    trace.scaler_state = scaler.state_dict()
    return trace


def _compare(got: Trace, want: Trace, atol: float) -> None:
    """Rank-local: same skipped steps as the reference, same scale after every step,
    losses, clip norms and final parameters within ``atol`` (see the note above)."""
    assert want.skipped == SKIPPED, f"the reference skipped {want.skipped}, expected {SKIPPED}"
    assert got.skipped == want.skipped, f"skipped {got.skipped} vs reference {want.skipped}"
    assert got.scales == want.scales, f"scales {got.scales} vs reference {want.scales}"
    assert got.scaler_state == want.scaler_state, (got.scaler_state, want.scaler_state)
    for what, a, b in (("loss", got.losses, want.losses), ("norm", got.norms, want.norms)):
        assert len(a) == len(b), f"{len(a)} {what}es vs reference {len(b)}"
        worst = max((abs(x - y) / max(abs(y), 1.0) for x, y in zip(a, b, strict=True)), default=0)
        assert worst <= atol, f"{what}: relative difference {worst:.3g} > {atol} ({a} vs {b})"
    assert list(got.params) == list(want.params), (list(got.params), list(want.params))
    for name, p in got.params.items():
        diff = (p - want.params[name]).abs().max().item()
        assert diff <= atol, f"parameter {name} differs by {diff:.3g} > {atol}"
    assert not got.warnings, f"ShardedGradScaler warned: {got.warnings}"


def _matches_reference(*, fused: bool, clip: bool, cls=fsdp_lite.ShardedGradScaler) -> None:
    got = _train_sharded(cls, fused=fused, clip=clip)
    want = _train_reference(fused=fused, clip=clip)
    atol = 1e-5 if clip else 1e-6
    agree("sharded fp16 training vs reference", lambda: _compare(got, want, atol))


def _stock_scaler_warns_and_drifts() -> None:
    """Without the fix: a one-rank overflow (step INJECT_STEP) is skipped by rank 1 only,
    so the ranks' scales differ after it, and the stock scaler warned once."""
    trace = _train_sharded(torch.amp.GradScaler, fused=False, clip=False, steps=INJECT_STEP + 2)
    scales: list[list[float]] = [[] for _ in range(WORLD)]
    dist.all_gather_object(scales, trace.scales)

    def check() -> None:
        assert len(trace.warnings) == 1, f"{len(trace.warnings)} warnings: {trace.warnings}"
        message = trace.warnings[0]
        assert "only its own shard grads" in message and MESSAGE in message, message
        assert scales[0][:INJECT_STEP] == scales[1][:INJECT_STEP], scales
        assert scales[0][INJECT_STEP] != scales[1][INJECT_STEP], f"scales agree: {scales}"

    agree("stock GradScaler over 2-rank shards", check)


def _cases(rank: int, world: int) -> dict[str, str | None]:
    return run_subtests(
        [
            (
                "ShardedGradScaler fp16 matches the GradScaler reference, one-rank overflow",
                functools.partial(_matches_reference, fused=False, clip=False),
            ),
            (
                "ShardedGradScaler with unscale_ and clip_grad_norm_ matches the reference",
                functools.partial(_matches_reference, fused=False, clip=True),
            ),
            (
                "ShardedGradScaler with fused AdamW matches the reference",
                functools.partial(_matches_reference, fused=True, clip=False),
            ),
            (
                "ShardedGradScaler() on the default device matches the reference",
                functools.partial(
                    _matches_reference, fused=False, clip=False, cls=_scaler_on_default_device
                ),
            ),
            (
                "stock GradScaler over 2-rank shards warns and its scales drift",
                _stock_scaler_warns_and_drifts,
            ),
        ]
    )


def test_sharded_grad_scaler_skips_like_the_single_process_reference() -> None:
    assert_subtests_passed(run_distributed(_cases, WORLD))
