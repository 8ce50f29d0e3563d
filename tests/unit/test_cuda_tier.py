"""The CUDA tier's one-process checks (``pytest -m cuda``; skipped without CUDA): a unit
on the device trains like a reference on the same device, in fp32 and bf16, with and
without CPU offload (pinned host shards), and its full state dict comes back on the CPU.
The multi-rank and NCCL checks are ``make gpu-check``'s (tests/gpu/gpu_check.py)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import fsdp_lite
from fsdp_lite.testing import GPT, GPTConfig
from fsdp_lite.testing.models import Block
from fsdp_lite.testing.reference import BF16, FP32, Run, compare_training

pytestmark = pytest.mark.cuda


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 64, (2, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _wrap(model, **kw) -> fsdp_lite.FSDPModule:
    return fsdp_lite.FSDPModule(
        model, auto_wrap_policy=fsdp_lite.wrap.by_type(Block), device="cuda", **kw
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("offload", [False, True])
def test_unit_on_cuda_matches_reference_on_cuda(world1, precision: str, offload: bool) -> None:
    mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16) if precision == "bf16" else None
    kw = {"mixed_precision": mp, "offload": fsdp_lite.CPUOffload() if offload else None}
    run = Run(
        name=f"cuda {precision} offload={offload}",
        make_model=functools.partial(GPT, GPTConfig()),
        batch=_batch,
        loss=lambda model, batch: model(*batch)[1],
        wrap=functools.partial(_wrap, **kw),
        tol=BF16 if precision == "bf16" else FP32,
        device="cuda",
    )
    compare_training(run)


def test_cpu_offload_shards_are_pinned_and_state_dict_is_on_cpu(world1) -> None:
    model = _wrap(GPT(GPTConfig()), offload=fsdp_lite.CPUOffload())
    shards = list(model.parameters())
    assert all(p.device.type == "cpu" and p.is_pinned() for p in shards)
    x, y = (t.cuda() for t in _batch(0))
    model(x, y)[1].backward()
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in shards)
    assert all(v.device.type == "cpu" for v in model.state_dict().values())


def test_load_after_an_eval_forward_with_cpu_offload(world1) -> None:
    """A forward with no backward leaves shard uploads unsynchronized; loading a state
    dict writes the host shards right after, and must wait for them (before_host_write)."""
    torch.manual_seed(0)
    model = _wrap(GPT(GPTConfig()), offload=fsdp_lite.CPUOffload())
    other = GPT(GPTConfig())
    x, _ = (t.cuda() for t in _batch(0))
    for _ in range(3):
        with torch.no_grad():
            model(x)
        model.load_state_dict(other.state_dict())
    with torch.no_grad():
        got, want = model(x)[0], other.cuda()(x)[0]
    torch.testing.assert_close(got, want)


def _hold_upload_stream(device: torch.device, seconds: float = 0.1) -> None:
    """Queue a spin on the side stream that carries CPU-offload uploads, so every upload
    issued next is still waiting when the host goes on: the race below then always shows
    instead of depending on timing."""
    from fsdp_lite.core import devices

    stream = devices._SIDE_STREAMS[device]
    rate = torch.cuda.get_device_properties(device).clock_rate * 1e3  # kHz -> cycles/s
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(seconds * rate))


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_validation_forward_between_backward_and_step_with_cpu_offload(world1, grad) -> None:
    """backward(), a validation forward, then opt.step(): the optimizer writes the pinned
    host shards that the forward's uploads read. The forward must see the shards from
    before the step (the reference's), never the optimizer's half-written update."""
    torch.manual_seed(0)
    ref = GPT(GPTConfig())
    model = _wrap(copy.deepcopy(ref), offload=fsdp_lite.CPUOffload())
    ref = ref.cuda()
    device = torch.device("cuda", torch.cuda.current_device())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        x, y = (t.cuda() for t in _batch(step))
        for m in (model, ref):
            m(x, y)[1].backward()
        _hold_upload_stream(device)
        with torch.set_grad_enabled(grad):
            got = model(x)[0].detach()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            want = ref(x)[0]
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(got, want, msg=lambda m, step=step: f"step {step}: {m}")
