"""Bad input gets a clear error that says what was wrong and what to do, before anything changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsdp_lite
from fsdp_lite.testing import GPT, GPTConfig
from fsdp_lite.testing.models import Block


def test_requires_initialized_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        fsdp_lite.FSDPModule(nn.Linear(2, 2))


def test_parameters_on_different_devices(world1) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"different devices \(\['cpu', 'meta'\]\)"):
        fsdp_lite.FSDPModule(model)
    assert isinstance(model[0].weight, nn.Parameter)  # untouched


def test_wrapping_twice(world1) -> None:
    inner = nn.Linear(2, 2)
    unit = fsdp_lite.FSDPModule(inner)
    with pytest.raises(ValueError, match="already wrapped"):
        fsdp_lite.FSDPModule(unit)
    with pytest.raises(ValueError, match="already wrapped"):
        fsdp_lite.FSDPModule(inner)


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
    root_slots = {s.name: s for f in model._flat_params for s in f.slots}
    assert len(root_slots["wte.weight"].locations) == 2  # wte.weight and lm_head.weight
    assert model.module.wte._flat_params == []  # the embedding unit owns nothing


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
    assert model.training_state is fsdp_lite.TrainingState.IDLE
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
