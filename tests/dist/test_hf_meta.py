"""Hugging Face models built on the meta device wrap with default arguments: HF's own init
(``_init_weights``) for their modules, and non-persistent buffers (rotary ``inv_freq``) equal
to the eager build's whatever ``param_init_fn`` is; loaded weights then give the eager
model's logits and training. Modules that nothing can initialize are named in errors."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import fsdp_lite
from fsdp_lite.addons.state_dict import clean_named_modules
from fsdp_lite.build.deferred_init import no_init
from fsdp_lite.testing import run_distributed

transformers = pytest.importorskip("transformers")

SIZES = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
)


def _configs() -> dict:
    return {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**SIZES)),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**SIZES)),
    }


def _build(cls: type, cfg: object, meta: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if not meta:
        return cls(cfg)
    with torch.device("meta"):
        return cls(cfg)


def _wrap(model: nn.Module, **kwargs: object) -> fsdp_lite.FSDPModule:
    policy = fsdp_lite.wrap.by_type(*fsdp_lite.wrap.transformer_layers(model))
    return fsdp_lite.FSDPModule(model, auto_wrap_policy=policy, **kwargs)


def _non_persistent(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{attr}".lstrip("."): m._buffers[attr]
        for name, m in clean_named_modules(model)
        for attr in m._non_persistent_buffers_set
        if m._buffers.get(attr) is not None
    }


def _check_buffers(wrapped: nn.Module, eager: nn.Module) -> None:
    want, got = _non_persistent(eager), _non_persistent(wrapped)
    assert sorted(got) == sorted(want) and want, (sorted(got), sorted(want))
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _default_init(cls: type, cfg: object, rank: int) -> None:
    eager = _build(cls, cfg, meta=False)
    model = _wrap(_build(cls, cfg, meta=True, seed=rank))  # rank 0's RNG everywhere
    _check_buffers(model, eager)
    std = cfg.initializer_range
    state = model.state_dict()
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, state)
    assert all(torch.equal(state[k], gathered[0][k]) for k in state)  # same on every rank
    for name, p in state.items():
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert p.eq(1).all(), name
        elif name.endswith("bias"):
            assert p.eq(0).all(), name
        else:  # Linear and Embedding weights: normal(0, initializer_range)
            assert abs(p.std().item() - std) < 0.15 * std, (name, p.std().item())
            assert abs(p.mean().item()) < 0.15 * std, (name, p.mean().item())


def _custom_init(cls: type, cfg: object, rank: int) -> None:
    def fill(module: nn.Module) -> None:
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            nn.init.constant_(t, 0.5)

    eager = _build(cls, cfg, meta=False)
    model = _wrap(_build(cls, cfg, meta=True), param_init_fn=fill)
    _check_buffers(model, eager)
    assert all(p.eq(0.5).all() for p in model.state_dict().values())


def _batch(cfg: object, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, cfg.vocab_size, (2, 12), generator=g)


def _loaded_trains_like_eager(cls: type, cfg: object, rank: int) -> None:
    eager = _build(cls, cfg, meta=False)
    model = _wrap(_build(cls, cfg, meta=True), param_init_fn=no_init)
    model.load_state_dict(eager.state_dict())
    _check_buffers(model, eager)
    ids = _batch(cfg, 0)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, eager(input_ids=ids).logits)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]
    for step in range(3):
        ids = _batch(cfg, step)  # the same batch on every rank: the mean gradient is eager's
        losses = []
        for m, opt in zip((model, eager), opts, strict=True):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-5, (step, losses)
    want = eager.state_dict()
    for k, v in model.state_dict().items():
        assert torch.allclose(v, want[k], atol=1e-5), k


class _Extra(nn.Module):  # a module HF's _init_weights does not know
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))


def _errors(cls: type, cfg: object, rank: int) -> None:
    model = _build(cls, cfg, meta=True)
    with torch.device("meta"):
        model.model.extra = _Extra()
    needle = "module 'model.extra' (_Extra) is on the meta device and its default init"
    with pytest.raises(RuntimeError, match=re.escape(needle) + ".*'w' uninitialized"):
        _wrap(model)

    class Table(nn.Linear):  # a non-persistent buffer nothing recomputes
        def __init__(self) -> None:
            super().__init__(2, 2)
            self.register_buffer("table", torch.arange(4.0), persistent=False)

    with torch.device("meta"):
        plain = nn.Sequential(nn.Linear(2, 2), Table())
    needle = "module '1' (Table) has non-persistent buffers 'table' on the meta device"
    with pytest.raises(RuntimeError, match=re.escape(needle)):
        fsdp_lite.FSDPModule(plain, param_init_fn=no_init)


def _cases(rank: int, world: int) -> list[str]:
    torch.set_num_threads(1)
    configs = _configs()
    cases = [
        (f"{arch}: {case.__name__}", case, cls, cfg)
        for arch, (cls, cfg) in configs.items()
        for case in (_default_init, _custom_init, _loaded_trains_like_eager)
    ]
    cases.append(("llama: _errors", _errors, *configs["llama"]))
    for name, case, cls, cfg in cases:
        try:
            case(cls, cfg, rank)
        except Exception as e:
            raise AssertionError(f"case {name!r} failed: {e}") from e
    return [name for name, *_ in cases]


def test_meta_built_hf_models_wrap_with_hf_init_and_eager_buffers() -> None:
    print(run_distributed(_cases, 2)[0])
