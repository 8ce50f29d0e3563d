"""Where each dtype lives: full params in param_dtype, gradients reduced in reduce_dtype
(seen at the collective), fp32 shard grads, buffers in buffer_dtype, BatchNorm in fp32;
and after backward every full buffer is freed and each shard holds ceil(numel / W)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsdp_lite
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import run_distributed

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16


class Probe(nn.Module):
    """Linear -> BatchNorm -> scale buffer -> Linear; records dtypes seen in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7))
        self.__dict__["layers"] = tuple(self.inner)  # unregistered handles, survive wrapping
        self.out = nn.Linear(7, 3)
        self.register_buffer("scale", torch.full((7,), 0.5))
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lin, bn = self.layers
        self.seen.update(input=x.dtype, linear_weight=lin.weight.dtype, bn_weight=bn.weight.dtype)
        self.seen.update(bn_running_mean=bn.running_mean.dtype, scale=self.scale.dtype)
        h = self.inner(x)
        self.seen["bn_output"] = h.dtype
        return self.out(h * self.scale.to(h.dtype))


CONFIGS = [  # (param, reduce, buffer)
    (bf16, f32, bf16),
    (f16, f16, None),
    (bf16, None, f16),
    (f32, f32, None),
]


def _dtype_table(rank: int, world: int) -> None:
    for param_dtype, reduce_dtype, buffer_dtype in CONFIGS:
        mp = fsdp_lite.MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)
        torch.manual_seed(0)
        probe = Probe()
        model = fsdp_lite.FSDPModule(
            probe, auto_wrap_policy=fsdp_lite.wrap.by_type(nn.Sequential), mixed_precision=mp
        )
        fsdp_lite.reset_stats(model)
        model(torch.randn(4, 5)).float().square().mean().backward()
        want_reduce = reduce_dtype or param_dtype
        norm_dtype = f32  # BatchNorm is in fp32_module_types by default
        assert probe.seen == {
            "input": param_dtype,
            "linear_weight": param_dtype,
            "bn_weight": norm_dtype,
            "bn_running_mean": norm_dtype,
            "scale": buffer_dtype or f32,
            "bn_output": param_dtype,
        }, (mp, probe.seen)
        stats = fsdp_lite.stats(model)["collectives"]
        if world > 1:
            name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
            assert set(stats["reduce_scatter"]["dtypes"]) == {name(want_reduce)}, (mp, stats)
            assert set(stats["all_gather"]["dtypes"]) == {name(param_dtype), "float32"}, (mp, stats)
        for unit in units_of(model):
            for flat in unit.flat_params:
                assert not flat.is_unsharded, unit.name
                assert flat.shard.numel() == -(-flat.numel // world)
                assert flat.shard.dtype == f32 and flat.shard.grad.dtype == f32
        sd = model.state_dict()
        assert all(v.dtype == f32 for k, v in sd.items() if v.is_floating_point()), sd
        assert sd["scale"].eq(0.5).all()


@pytest.mark.parametrize("world", [1, 2])
def test_dtype_table(world: int) -> None:
    run_distributed(_dtype_table, world)


def _widened_in_pieces(rank: int, world: int) -> None:
    """A bf16 gradient reduced in fp32 in column pieces (a large unit's path, forced here
    with a tiny piece size) gives bit-identical shard grads to the whole reduce-scatter,
    and trains like the single-process reference."""
    import functools

    from cases import B_PER_RANK, gpt, gpt_run, token_batch, wrap_blocks

    from fsdp_lite.core import reduce
    from fsdp_lite.testing.reference import compare_training

    mp = fsdp_lite.MixedPrecision(param_dtype=bf16, reduce_dtype=f32)
    grads, calls = {}, {}
    for piece_bytes in (reduce.WIDEN_PIECE_BYTES, 4096):
        reduce.WIDEN_PIECE_BYTES, saved = piece_bytes, reduce.WIDEN_PIECE_BYTES
        try:
            torch.manual_seed(0)
            model = wrap_blocks(gpt(), mixed_precision=mp)
            fsdp_lite.reset_stats(model)
            mine = slice(rank * B_PER_RANK, (rank + 1) * B_PER_RANK)
            for step in range(2):
                x, y = token_batch(world, step)
                model(x[mine], y[mine])[1].backward()
            calls[piece_bytes] = fsdp_lite.stats(model)["collectives"]["reduce_scatter"]["calls"]
            grads[piece_bytes] = [p.grad.clone() for p in model.parameters()]
            if piece_bytes == 4096:
                wrap = functools.partial(wrap_blocks, mixed_precision=mp)
                compare_training(gpt_run("widened in pieces", world, "bf16", wrap=wrap))
        finally:
            reduce.WIDEN_PIECE_BYTES = saved
    whole, pieces = grads.values()
    assert all(torch.equal(a, b) for a, b in zip(whole, pieces, strict=True))
    assert calls[4096] > 2 * calls[reduce.WIDEN_PIECE_BYTES], calls


def test_widened_reduce_in_pieces() -> None:
    run_distributed(_widened_in_pieces, 2)
