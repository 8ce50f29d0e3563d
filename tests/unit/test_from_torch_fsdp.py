"""What FSDP1 and FSDP2 users bring to ``FSDPModule``: their keyword arguments, option
objects, wrap policies and method names. Each is refused before anything changes, and the
message names an fsdp_lite call that exists and, where it spells one, builds a model that
trains like the unwrapped one."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.fsdp import wrap as torch_wrap

import fsdp_lite
from fsdp_lite.build.from_torch_fsdp import REFUSED_METHODS
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import GPT, GPTConfig
from fsdp_lite.testing.models import Block


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


_PASS = re.compile(
    r"pass (auto_wrap_policy|mixed_precision|offload)=(fsdp_lite\.[\w.]+\(.*?\))(?=$| \(|;| and )"
)

# (keyword arguments as an FSDP user writes them, what the message must say)
REFUSED_ARGUMENTS = {
    "FSDP1 sharding_strategy=SHARD_GRAD_OP": (
        {"sharding_strategy": torch_fsdp.ShardingStrategy.SHARD_GRAD_OP},
        "pass reshard_after_forward=False",
    ),
    "FSDP1 sharding_strategy=FULL_SHARD": (
        {"sharding_strategy": torch_fsdp.ShardingStrategy.FULL_SHARD},
        "it is the default: drop the argument",
    ),
    "FSDP1 sharding_strategy=HYBRID_SHARD": (
        {"sharding_strategy": torch_fsdp.ShardingStrategy.HYBRID_SHARD},
        "fsdp_lite.hybrid_groups(ranks_per_node)",
    ),
    "FSDP1 cpu_offload=": (
        {"cpu_offload": torch_fsdp.CPUOffload(offload_params=True)},
        "pass offload=fsdp_lite.CPUOffload()",
    ),
    "FSDP1 device_id=": ({"device_id": 0}, "pass device=0"),
    "FSDP1 cpu_offload=None": ({"cpu_offload": None}, "pass offload=fsdp_lite.CPUOffload(); else"),
    "FSDP2 mp_policy=None": ({"mp_policy": None}, "fsdp_lite.MixedPrecision(param_dtype=..."),
    "FSDP1 backward_prefetch=": (
        {"backward_prefetch": torch_fsdp.BackwardPrefetch.BACKWARD_PRE},
        "fsdp_lite prefetches by default",
    ),
    "FSDP1 limit_all_gathers=": ({"limit_all_gathers": True}, "max_in_flight=2"),
    "FSDP1 forward_prefetch=": ({"forward_prefetch": True}, "prefetch=fsdp_lite.PrefetchPolicy"),
    "FSDP1 ignored_states=": ({"ignored_states": []}, "ignored_modules=[...]"),
    "FSDP2 mp_policy=": (
        {"mp_policy": torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
        "pass mixed_precision=fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.bfloat16)",
    ),
    "FSDP2 mp_policy= (no dtype)": (
        {"mp_policy": torch_fsdp.MixedPrecisionPolicy()},
        "it changes no dtype: drop it",
    ),
    "FSDP2 offload_policy=": (
        {"offload_policy": torch_fsdp.CPUOffloadPolicy(pin_memory=False)},
        "pass offload=fsdp_lite.CPUOffload(pin_memory=False)",
    ),
    "FSDP2 shard_placement_fn=": (
        {"shard_placement_fn": lambda p: None},
        "optimizer_params='whole'",
    ),
    "FSDP2 reshard_after_forward=<int>": (
        {"reshard_after_forward": 2},
        "no FSDP2-style resharding to a smaller group",
    ),
    "FSDP1 MixedPrecision as mixed_precision": (
        {"mixed_precision": torch_fsdp.MixedPrecision(torch.bfloat16, torch.float32)},
        "pass mixed_precision=fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32)",
    ),
    "FSDP1 MixedPrecision, buffers, inputs not cast": (
        {
            "mixed_precision": torch_fsdp.MixedPrecision(
                torch.float16, buffer_dtype=torch.float16, cast_root_forward_inputs=False
            )
        },
        "pass mixed_precision=fsdp_lite.MixedPrecision(param_dtype=torch.float16, "
        "reduce_dtype=torch.float16, buffer_dtype=torch.float16, cast_inputs=False)",
    ),
    "FSDP2 MixedPrecisionPolicy as mixed_precision, output_dtype": (
        {
            "mixed_precision": torch_fsdp.MixedPrecisionPolicy(
                torch.bfloat16, torch.float32, output_dtype=torch.float32
            )
        },
        "cast them to torch.float32 yourself",
    ),
    "FSDP1 CPUOffload as offload": (
        {"offload": torch_fsdp.CPUOffload(offload_params=True)},
        "pass offload=fsdp_lite.CPUOffload()",
    ),
    "FSDP1 CPUOffload(offload_params=False) as offload": (
        {"offload": torch_fsdp.CPUOffload()},
        "it offloads nothing: drop it",
    ),
    "FSDP1 BackwardPrefetch as prefetch": (
        {"prefetch": torch_fsdp.BackwardPrefetch.BACKWARD_POST},
        "prefetch: BackwardPrefetch.BACKWARD_POST is PyTorch FSDP's",
    ),
    "FSDP1 ModuleWrapPolicy": (
        {"auto_wrap_policy": torch_wrap.ModuleWrapPolicy({Block})},
        "pass auto_wrap_policy=fsdp_lite.wrap.by_type(Block)",
    ),
    "FSDP1 transformer_auto_wrap_policy": (
        {
            "auto_wrap_policy": functools.partial(
                torch_wrap.transformer_auto_wrap_policy, transformer_layer_cls={Block}
            )
        },
        "pass auto_wrap_policy=fsdp_lite.wrap.by_type(Block)",
    ),
    "FSDP1 size_based_auto_wrap_policy": (
        {
            "auto_wrap_policy": functools.partial(
                torch_wrap.size_based_auto_wrap_policy, min_num_params=5000
            )
        },
        "pass auto_wrap_policy=fsdp_lite.wrap.by_size(5000)",
    ),
    "FSDP1 lambda_auto_wrap_policy": (
        {
            "auto_wrap_policy": functools.partial(
                torch_wrap.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Block)
            )
        },
        "auto_wrap_policy=lambda_fn",
    ),
    "FSDP1 CustomPolicy": (
        {"auto_wrap_policy": torch_wrap.CustomPolicy(lambda m: isinstance(m, Block))},
        "pass its lambda_fn as auto_wrap_policy",
    ),
    "an FSDP1-style policy of one's own": (
        {"auto_wrap_policy": lambda module, recurse, nonwrapped_numel: True},
        "take the module alone, policy(module) -> bool",
    ),
}


@pytest.mark.parametrize("case", REFUSED_ARGUMENTS)
def test_fsdp_arguments_are_refused_with_the_fsdp_lite_argument(world1, case: str) -> None:
    """Refused before anything changes; where the message spells an fsdp_lite object, it
    builds, and a model wrapped with it trains like the unwrapped model."""
    kwargs, says = REFUSED_ARGUMENTS[case]
    model = _gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError) as err:
        fsdp_lite.FSDPModule(model, **kwargs)
    msg = str(err.value)
    assert says in msg and ("PyTorch FSDP's" in msg or "FSDP2-style" in msg), msg
    assert not units_of(model) and all(
        torch.equal(v, before[k]) for k, v in model.state_dict().items()
    )
    advised = _PASS.search(msg)
    if advised is None or "..." in advised.group(2):  # no object spelled, or a template
        return
    name, expression = advised.groups()
    value = eval(expression, {"fsdp_lite": fsdp_lite, "torch": torch, "Block": Block})
    _trains_like_unwrapped({name: value}, mixed=name == "mixed_precision")


def _trains_like_unwrapped(kwargs: dict, mixed: bool) -> None:
    """Two steps of the model wrapped with ``kwargs`` against the unwrapped model (W=1)."""
    ref, model = _gpt(), fsdp_lite.FSDPModule(_gpt(), **kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        losses = []
        for m, opt in zip((ref, model), opts, strict=True):
            loss = m(x, x)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        torch.testing.assert_close(losses[1], losses[0], rtol=3e-2 if mixed else 1e-5, atol=0)


def test_an_unknown_keyword_is_refused_as_python_would(world1) -> None:
    with pytest.raises(
        TypeError, match=r"FSDPModule\(\) got an unexpected keyword argument 'shard'"
    ):
        fsdp_lite.FSDPModule(_gpt(), shard=True)


@pytest.mark.parametrize("name", sorted(REFUSED_METHODS))
def test_fsdp_methods_say_what_to_call_instead(world1, name: str) -> None:
    """On the class and on an instance: ``AttributeError`` (so ``hasattr`` is False) naming
    the fsdp_lite call, which exists."""
    model = fsdp_lite.FSDPModule(_gpt(), auto_wrap_policy=fsdp_lite.wrap.by_type(Block))
    for owner in (model, fsdp_lite.FSDPModule, model.module.blocks[0]):
        assert not hasattr(owner, name)
        with pytest.raises(AttributeError, match=f"has no {name}\\(\\) \\(PyTorch FSDP's\\): "):
            getattr(owner, name)
    advice = REFUSED_METHODS[name]
    for attr in re.findall(r"\bmodel\.(\w+)\(", advice) + re.findall(r"\bunit\.(\w+)\(", advice):
        assert callable(getattr(model, attr)), attr
    for path in re.findall(r"\bfsdp_lite\.([\w.]+)", advice):
        obj = fsdp_lite
        for part in path.rstrip(".").split("."):
            obj = getattr(obj, part)


def test_a_wrapped_module_keeps_its_own_attribute_of_such_a_name(world1) -> None:
    """Attribute access still reaches the wrapped module first: a model that has its own
    ``reshard`` keeps it."""

    class WithReshard(nn.Linear):
        def reshard(self) -> str:
            return "the model's own"

    model = fsdp_lite.FSDPModule(WithReshard(4, 4))
    assert model.reshard() == "the model's own"


def test_the_planner_refuses_them_too() -> None:
    x = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(TypeError, match=r"pass auto_wrap_policy=fsdp_lite\.wrap\.by_type\(Block\)"):
        fsdp_lite.estimate_memory(
            _gpt(), (x, x), 4, auto_wrap_policy=torch_wrap.ModuleWrapPolicy({Block})
        )


def test_set_reshard_after_forward_refuses_fsdp2s_int(world1) -> None:
    model = fsdp_lite.FSDPModule(_gpt(), auto_wrap_policy=fsdp_lite.wrap.by_type(Block))
    with pytest.raises(TypeError, match="must be True, False or None, got 8"):
        model.set_reshard_after_forward(8)
    assert [u.reshard_after_forward for u in units_of(model)] == [None] * 3  # unchanged
