"""A model loaded in bf16 or fp16 trains on fp32 masters (W=2, gloo).

The reference rounds exactly as fsdp_lite does, on one process: fp32 master weights,
a low-precision copy of them for compute, each rank's slice of the global batch run
forward and backward separately in that copy, the slices' gradients cast to fp32,
summed and halved, and AdamW stepping the fp32 masters. So the comparison is tight
(``EXACT``): a bf16 master, a bf16 reduction or a missing division shows up.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from hf_cases import llama, wrap_layers

from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.subtests import agree, assert_subtests_passed, run_subtests

WORLD = 2
STEPS = 6
# Measured: identical to the last bit on CPU (same kernels, same shapes, fp32 sum of two
# per-rank gradients is order-free). A bf16 reduction or bf16 masters are ~1e-3 off.
EXACT = 1e-6


def _batches(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (2 * WORLD, 12), generator=g) for _ in range(STEPS)]


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, eps=1e-6)


def _reference(model: torch.nn.Module, batches: list[torch.Tensor]) -> tuple[list, dict]:
    """fp32 masters, low-precision compute, per-rank slices reduced in fp32."""
    compute = model
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in model.named_parameters()}
    opt = _optimizer(masters.values())
    losses = []
    for tokens in batches:
        with torch.no_grad():
            for n, p in compute.named_parameters():
                p.copy_(masters[n])
        grads = {n: torch.zeros_like(m) for n, m in masters.items()}
        step_loss = 0.0
        for piece in tokens.chunk(WORLD):
            compute.zero_grad(set_to_none=True)
            loss = _loss(compute, piece)
            loss.backward()
            step_loss += loss.item() / WORLD
            for n, p in compute.named_parameters():
                grads[n] += p.grad.float()
        for n, m in masters.items():
            m.grad = grads[n] / WORLD
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
    return losses, {n: m.detach() for n, m in masters.items()}


def _train_loaded(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    loaded = llama().to(dtype)  # as from_pretrained(..., torch_dtype=dtype)
    batches = _batches(loaded.config.vocab_size)
    ref_losses, ref_params = _reference(copy.deepcopy(loaded), batches)
    model = wrap_layers(loaded)
    opt = _optimizer(model.parameters())
    rank = dist.get_rank()
    losses = []
    for tokens in batches:
        loss = _loss(model, tokens.chunk(WORLD)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)

    def check() -> None:
        for p in model.parameters():
            assert p.dtype == torch.float32, f"master shard is {p.dtype}"
            assert p.grad is not None and p.grad.dtype == torch.float32, "shard grad not fp32"
        for state in opt.state.values():
            assert state["exp_avg"].dtype == torch.float32, "optimizer state not fp32"
        for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(got - want) <= EXACT * abs(want), f"step {step}: {got} vs {want}"

    agree(f"{dtype} masters", check)
    params = model.state_dict()

    def check_params() -> None:
        for name, want in ref_params.items():
            got = params[name].float()
            diff = (got - want).abs().max().item()
            assert diff <= EXACT, f"{name}: max |diff| {diff:.3g} after {STEPS} steps"

    agree(f"{dtype} parameters", check_params)


def _cast_after_wrapping() -> None:
    model = wrap_layers(llama().to(torch.bfloat16))
    for cast in (lambda: model.to(torch.bfloat16), model.half, model.bfloat16):
        with pytest.raises(TypeError, match="would cast its fp32 master shards.*MixedPrecision"):
            cast()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.float()  # no change: allowed
    model.to("cpu")


def _cases(rank: int, world: int) -> dict:
    return run_subtests(
        [
            ("bf16-loaded model trains on fp32 masters", lambda: _train_loaded(torch.bfloat16)),
            ("fp16-loaded model trains on fp32 masters", lambda: _train_loaded(torch.float16)),
            ("model.to(dtype) after wrapping is refused", _cast_after_wrapping),
        ]
    )


def test_low_precision_models_train_on_fp32_masters() -> None:
    assert_subtests_passed(run_distributed(_cases, WORLD, timeout=300))
