"""Bad input gets a clear error that says what was wrong and what to do, before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fsdp_lite
from fsdp_lite.core.tree import unit_of, units_of
from fsdp_lite.testing import GPT, GPTConfig
from fsdp_lite.testing.models import Block


def test_requires_initialized_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        fsdp_lite.FSDPModule(nn.Linear(2, 2))


class _ReportsCuda(nn.Parameter):
    """A CPU parameter that says it lives on cuda:0 (this machine has one device type)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def test_parameters_on_different_devices(world1) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].weight = _ReportsCuda(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"different devices \(\['cpu', 'cuda:0'\]\)"):
        fsdp_lite.FSDPModule(model)
    assert isinstance(model[0].weight, nn.Parameter)  # untouched


def test_wrapping_twice(world1) -> None:
    """The module inside a unit is refused; the unit itself may be wrapped again (an outer
    unit around a wrapped model: tests/dist/test_state_dict_type.py), by one outer unit."""
    inner = nn.Linear(2, 2)
    unit = fsdp_lite.FSDPModule(inner)
    with pytest.raises(ValueError, match="already wrapped"):
        fsdp_lite.FSDPModule(inner)
    fsdp_lite.FSDPModule(unit)
    with pytest.raises(ValueError, match="already wrapped"):
        fsdp_lite.FSDPModule(unit)


def test_integer_parameter(world1) -> None:
    model = nn.Linear(2, 2)
    model.steps = nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match="'steps' has dtype torch.int64"):
        fsdp_lite.FSDPModule(model)


def test_tie_across_hand_wrapped_units(world1) -> None:
    gpt = GPT(GPTConfig())
    gpt.wte = fsdp_lite.FSDPModule(gpt.wte)  # lm_head.weight is the same tensor
    with pytest.raises(ValueError, match="'lm_head.weight' is tied .* nested unit 'wte'"):
        fsdp_lite.FSDPModule(gpt)


def test_policy_keeps_tie_in_common_ancestor(world1) -> None:
    gpt = GPT(GPTConfig())
    policy = fsdp_lite.wrap.by_type(nn.Embedding, Block)
    model = fsdp_lite.FSDPModule(gpt, auto_wrap_policy=policy)
    root_slots = {s.name: s for f in model._unit.flat_params for s in f.slots}
    assert len(root_slots["wte.weight"].locations) == 2  # wte.weight and lm_head.weight
    assert unit_of(model.module.wte) is None  # it holds only the tie: no (empty) unit
    assert unit_of(model.module.wpe) is not None  # the untied position embedding has one


def test_wrong_state_names_unit_and_states(world1) -> None:
    class CallsBack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.callback = None

        def forward(self, x):
            if self.callback is not None:
                self.callback()
            return self.lin(x)

    inner = CallsBack()
    model = fsdp_lite.FSDPModule(inner)
    inner.callback = lambda: model.clip_grad_norm_(1.0)
    with pytest.raises(
        fsdp_lite.FSDPStateError,
        match="cannot clip_grad_norm_: it is in state FORWARD, expected IDLE",
    ):
        model(torch.ones(1, 3))
    # the failed iteration left the unit usable
    assert model.training_state is fsdp_lite.core.state.TrainingState.IDLE
    inner.callback = None
    model(torch.ones(1, 3)).sum().backward()
    assert model.flat_param_0.grad is not None


def test_mixed_precision_validation() -> None:
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        fsdp_lite.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(ValueError, match="reduce_dtype"):
        fsdp_lite.MixedPrecision(reduce_dtype=torch.float64)
    with pytest.raises(ValueError, match="fp32_module_types"):
        fsdp_lite.MixedPrecision(fp32_module_types=[nn.BatchNorm1d])
    with pytest.raises(Exception, match="cannot assign"):
        fsdp_lite.MixedPrecision().param_dtype = torch.float32  # frozen


def test_policy_validation() -> None:
    with pytest.raises(TypeError):
        fsdp_lite.wrap.by_type("Block")
    with pytest.raises(ValueError):
        fsdp_lite.wrap.by_size(0)
    with pytest.raises(TypeError):
        fsdp_lite.wrap.any_of()


def test_optimizer_built_before_wrapping(world1) -> None:
    module = nn.Linear(3, 3)
    early = torch.optim.SGD(module.parameters(), lr=0.1)
    model = fsdp_lite.FSDPModule(module)
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="'weight', an original parameter .* after wrapping"):
        early.step()
    late = torch.optim.SGD(model.parameters(), lr=0.1)
    late.step()  # the rule, followed


def test_nonfinite_grad_norm_reported_with_unit(world1) -> None:
    model = fsdp_lite.FSDPModule(
        nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)),
        auto_wrap_policy=fsdp_lite.wrap.by_type(nn.Linear),
    )
    model(torch.tensor([[1.0, float("inf"), 0.0]])).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = model.clip_grad_norm_(1.0)  # no host sync: no warning either
    assert not torch.isfinite(norm)
    for p, g in zip(model.parameters(), grads, strict=True):  # left unscaled
        assert torch.equal(p.grad.nan_to_num(), g.nan_to_num())
    with pytest.raises(RuntimeError, match=r"gradient norm is .*non-finite grads in \['0'"):
        model.clip_grad_norm_(1.0, error_if_nonfinite=True)


class _FailsInBackward(torch.autograd.Function):
    fail = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailsInBackward.fail:
            raise RuntimeError("injected backward failure")
        return grad


class _Fails(nn.Module):
    def forward(self, x):
        return _FailsInBackward.apply(x)


def _fails_between_units() -> nn.Sequential:
    """Three units whose gradients are reduced before the failure, one after."""
    layers = (nn.Linear(3, 4), _Fails(), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    return nn.Sequential(*layers)


def test_exception_in_backward_leaves_model_usable(world1) -> None:
    """The gradients the failed backward reduced before it raised are dropped."""
    torch.manual_seed(0)
    plain = _fails_between_units()
    model = fsdp_lite.FSDPModule(
        copy.deepcopy(plain), auto_wrap_policy=fsdp_lite.wrap.by_type(nn.Linear)
    )
    x = torch.randn(5, 3)
    with pytest.raises(RuntimeError, match="injected backward failure"):
        model(x).sum().backward()  # fails between the two units' backward
    assert model.training_state is not fsdp_lite.core.state.TrainingState.IDLE  # stuck mid-backward
    _FailsInBackward.fail = False
    with pytest.warns(UserWarning, match="previous backward did not finish"):
        out = model(x)
    out.sum().backward()
    plain(x).sum().backward()
    for unit in units_of(model):
        assert unit.state is fsdp_lite.core.state.TrainingState.IDLE
        assert not any(f.is_unsharded for f in unit.flat_params)
    got = fsdp_lite.addons.state_dict.full_grads(model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.grad)  # no stale gradient from the failed step


def test_exception_in_backward_while_accumulating_warns(world1) -> None:
    """A failed backward after an earlier one (accumulating without no_sync) added part of
    its gradients to that one's: they stay, as in a model without fsdp_lite, with a
    warning saying so; zero_grad drops them."""
    torch.manual_seed(0)
    plain = _fails_between_units()
    model = fsdp_lite.FSDPModule(
        copy.deepcopy(plain), auto_wrap_policy=fsdp_lite.wrap.by_type(nn.Linear)
    )
    x = torch.randn(5, 3)
    try:
        _FailsInBackward.fail = False
        model(x).sum().backward()  # the first micro-batch
        _FailsInBackward.fail = True
        with pytest.raises(RuntimeError, match="injected backward failure"):
            model(x).sum().backward()
    finally:
        _FailsInBackward.fail = False
    with pytest.warns(UserWarning) as caught:
        out = model(x)
    said = " ".join(str(w.message) for w in caught)
    assert "previous backward did not finish" in said, said
    assert "added part of its gradients to those of earlier backwards" in said, said
    model.zero_grad()
    out.sum().backward()
    plain(x).sum().backward()
    got = fsdp_lite.addons.state_dict.full_grads(model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.grad)


def test_tie_across_sibling_units_wrapped_by_hand(world1) -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    m[1].weight = m[0].weight
    m[0] = fsdp_lite.FSDPModule(m[0])
    with pytest.raises(ValueError, match="tied to 'weight', which another unit"):
        fsdp_lite.FSDPModule(m[1])


def test_tie_between_fp32_module_and_other_under_mixed_precision(world1) -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.bn = nn.LayerNorm(4), nn.BatchNorm1d(4)
            self.bn.weight = self.ln.weight

        def forward(self, x):
            return self.bn(self.ln(x))

    mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one compute dtype"):
        fsdp_lite.FSDPModule(M(), mixed_precision=mp)
    fsdp_lite.FSDPModule(M())(torch.randn(3, 4))  # fine without mixed precision


def test_shared_module_split_by_hand_wrapping(world1) -> None:
    shared = nn.Linear(4, 4)
    m = nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared))
    m[0] = fsdp_lite.FSDPModule(m[0])  # holds one of shared's two places
    with pytest.raises(ValueError, match=r"several places \(0\.0, 1\.0\).*unit '0'"):
        fsdp_lite.FSDPModule(m)


def test_shared_module_inside_one_hand_wrapped_unit_is_fine(world1) -> None:
    shared = nn.Linear(4, 4)
    inner = nn.Sequential(shared, nn.ReLU(), shared)
    m = nn.Sequential(fsdp_lite.FSDPModule(inner), nn.Linear(4, 2))
    model = fsdp_lite.FSDPModule(m)
    model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_optimizer_params_one_option(world1) -> None:
    """One option says what the optimizer sees; the older booleans map onto it, and a
    contradiction or an unknown value is refused before the module changes."""
    names = {}
    for kw in ({}, {"use_orig_params": True}, {"whole_params": True},
               {"optimizer_params": "pieces"}, {"optimizer_params": "whole"}):  # fmt: skip
        model = fsdp_lite.FSDPModule(nn.Linear(2, 2), **kw)
        names[str(kw)] = sorted(n for n, _ in model.named_parameters())
    assert names["{}"] == ["flat_param_0"], names
    orig = ["bias", "weight"]
    assert all(v == orig for k, v in names.items() if k != "{}"), names
    for kw, match in (
        ({"optimizer_params": "flat", "use_orig_params": True}, "contradicts use_orig_params"),
        ({"optimizer_params": "orig"}, r"one of \('flat', 'pieces', 'whole'\)"),
    ):
        inner = nn.Linear(2, 2)
        with pytest.raises(ValueError, match=match):
            fsdp_lite.FSDPModule(inner, **kw)
        assert isinstance(inner.weight, nn.Parameter) and inner.weight.numel() == 4
