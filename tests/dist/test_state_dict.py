"""Full state dicts: the unwrapped module's keys, order and values; loading both ways;
clear errors that load nothing; rank0_only in both directions."""

from __future__ import annotations

import pytest
import torch
from cases import cross_tied_gpt, frozen_gpt, gpt, token_batch, wrap_blocks, wrap_stages

import fsdp_lite
from fsdp_lite.testing import ConvNet, run_distributed


def _assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want), (list(got), list(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].device.type == "cpu", k
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


def _roundtrip(rank: int, world: int) -> None:
    for make, wrap in ((gpt, wrap_blocks), (ConvNet, wrap_stages)):
        for raf in (True, False):
            torch.manual_seed(0)
            plain = make()
            model = wrap(make(), reshard_after_forward=raf)  # different init: seed moved on
            model.load_state_dict(plain.state_dict())
            _assert_same(model.state_dict(), plain.state_dict())
            # trained a little, the wrapped model's dict loads into a plain module
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            _loss(model, world, rank).backward()
            opt.step()
            fresh = make()
            fresh.load_state_dict(model.state_dict())
            _assert_same(fresh.state_dict(), model.state_dict())
            # a forward with raf=False keeps full params alive: loading must not leave them stale
            _loss(model, world, rank)
            model.load_state_dict(plain.state_dict())
            plain.eval(), model.eval()
            x = _inputs(make, world, rank)
            with torch.no_grad():
                torch.testing.assert_close(_out(model(x)), _out(plain(x)), rtol=1e-5, atol=1e-6)
    _errors(rank, world)
    _sync_module_states(rank, world)
    _rank0_only(rank, world)


def _rank0_only(rank: int, world: int) -> None:
    """rank0_only both ways: only rank 0 holds a dict; the others get {} and pass {}.
    Tied (in and across units), frozen, buffers, mixed precision (the dict stays fp32)."""
    bf16 = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    cases = [
        (gpt, wrap_blocks, {}),
        (cross_tied_gpt, wrap_blocks, {}),
        (frozen_gpt, wrap_blocks, {}),
        (gpt, wrap_blocks, {"mixed_precision": bf16}),
        (ConvNet, wrap_stages, {"mixed_precision": bf16}),
    ]
    for make, wrap, kwargs in cases:
        torch.manual_seed(0)
        plain = make()
        if make is ConvNet:
            plain.stage2[1].running_var.fill_(2.5)  # buffers travel by broadcast too
        model = wrap(make(), **kwargs)
        model.load_state_dict(plain.state_dict() if rank == 0 else {}, rank0_only=True)
        got = model.state_dict(rank0_only=True)
        if rank == 0:
            _assert_same(got, plain.state_dict())
        else:
            assert got == {}
        _assert_same(model.state_dict(), plain.state_dict())  # every rank got rank 0's values
    good = plain.state_dict()
    bad = {k: v for k, v in good.items() if k != "head.bias"}
    with pytest.raises(RuntimeError, match=r"nothing was loaded.*missing keys: \['head.bias'\]"):
        model.load_state_dict(bad if rank == 0 else {}, rank0_only=True)  # raised on every rank
    _assert_same(model.state_dict(), good)


def _sync_module_states(rank: int, world: int) -> None:
    """Ranks built with different seeds start from rank 0's parameters and buffers."""
    torch.manual_seed(0)
    want = ConvNet()
    want.stage1[1].running_mean.fill_(3.0)
    torch.manual_seed(rank)
    mine = ConvNet()
    if rank == 0:
        mine.stage1[1].running_mean.fill_(3.0)
    model = wrap_stages(mine, sync_module_states=True)
    _assert_same(model.state_dict(), want.state_dict())


def _inputs(make, world, rank):
    if make is ConvNet:
        return torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(rank))
    return token_batch(world, 0)[0].chunk(world)[rank]


def _out(out):
    return out[0] if isinstance(out, tuple) else out


def _loss(model, world, rank):
    out = _out(model(_inputs(type(model.module), world, rank)))
    return out.float().square().mean()


def _errors(rank: int, world: int) -> None:
    model = wrap_blocks(gpt())
    good = model.state_dict()
    bad_cases = {
        "missing keys: ['ln_f.bias']": {k: v for k, v in good.items() if k != "ln_f.bias"},
        "unexpected keys: ['extra']": {**good, "extra": torch.zeros(1)},
        "ln_f.weight: checkpoint (3,), model (32,)": {**good, "ln_f.weight": torch.zeros(3)},
        "module.wte.weight": {"module." + k: v for k, v in good.items()},
    }
    for needle, sd in bad_cases.items():
        sd = {k: (v + 1 if k != "ln_f.weight" or v.numel() != 3 else v) for k, v in sd.items()}
        with pytest.raises(RuntimeError, match="nothing was loaded") as err:
            model.load_state_dict(sd)
        assert needle in str(err.value), str(err.value)
        _assert_same(model.state_dict(), good)  # nothing changed
    partial = {"ln_f.bias": torch.ones(32)}
    result = model.load_state_dict(partial, strict=False)
    assert "ln_f.bias" not in result.missing_keys and "wte.weight" in result.missing_keys
    after = model.state_dict()
    assert after["ln_f.bias"].eq(1).all()
    torch.testing.assert_close(after["wte.weight"], good["wte.weight"])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_full_state_dict_roundtrip(world: int) -> None:
    run_distributed(_roundtrip, world)
