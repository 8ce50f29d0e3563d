"""ignored_modules / ignored_params (FSDP1's and FSDP2's): the modules named stay whole on
every rank, outside every unit, and train like the rest of the model.

Each training case runs ``compare_training`` against a single-process reference on the
global batch (losses and gradients every step, the full state dict at the end), with
blocks as units and the head or a middle block ignored; the ignored parameters are the
same objects before and after wrapping and equal on every rank after every step."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from cases import gpt, gpt_loss, token_batch
from torch import nn

import fsdp_lite
from fsdp_lite.core.optim_view import replicated_ranks
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.models import Block, Linear
from fsdp_lite.testing.reference import BF16, FP32, Run, compare_training
from fsdp_lite.testing.subtests import agree, assert_subtests_passed, run_subtests

BLOCKS = fsdp_lite.wrap.by_type(Block)


class Fp32Head(nn.Module):
    """The output head, computing in fp32 whatever its input (an ignored module computes in
    its own dtype under mixed precision), with a float buffer that must stay fp32."""

    def __init__(self, n_embd: int, vocab: int) -> None:
        super().__init__()
        self.proj = Linear(n_embd, vocab, bias=True)
        self.register_buffer("scale", torch.full((), 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.float()) * self.scale


def untied_gpt(**kw) -> nn.Module:
    return gpt(tie_weights=False, **kw)


def fp32_head_gpt() -> nn.Module:
    model = untied_gpt()
    model.lm_head = Fp32Head(model.cfg.n_embd, model.cfg.vocab_size)
    return model


def _head(model: nn.Module) -> nn.Module:
    return model.lm_head


def _middle(model: nn.Module) -> nn.Module:
    return model.blocks[1]


def _same_on_every_rank(what: str, tensors: list[torch.Tensor]) -> None:
    """Every rank holds bitwise the same values (replicas trained together)."""
    mine = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(got, mine)

    def check() -> None:
        for r, other in enumerate(got):
            assert torch.equal(other, mine), f"{what}: rank {r} holds other values"

    agree(what, check)


class _Ignoring:
    """The wrap of a Run: blocks as units, ``pick(model)`` ignored (as a module, or with
    ``as_params`` as FSDP2's ignored_params); checks the ignored parameters kept their
    identity, stay plain parameters of their modules, and no unit holds them."""

    def __init__(self, pick, as_params: bool = False, **kwargs) -> None:
        self.pick, self.as_params, self.kwargs = pick, as_params, kwargs
        self.params: list[nn.Parameter] = []
        self.frozen_values: list[torch.Tensor] = []

    def __call__(self, model: nn.Module) -> fsdp_lite.FSDPModule:
        ignored = self.pick(model)
        self.params = list(ignored.parameters())
        self.frozen_values = [p.detach().clone() for p in self.params if not p.requires_grad]
        if self.as_params:
            kwargs = {"ignored_params": set(self.params)}
        else:
            kwargs = {"ignored_modules": [ignored]}
        wrapped = fsdp_lite.FSDPModule(model, auto_wrap_policy=BLOCKS, **kwargs, **self.kwargs)
        assert self.pick(wrapped.module) is ignored, "the ignored module was replaced"
        assert list(ignored.parameters()) == self.params, "ignored parameters changed identity"
        assert all(type(p) is nn.Parameter and p.numel() > 0 for p in self.params)
        mine = {id(p) for p in wrapped.parameters()}
        assert all(id(p) in mine for p in self.params), "parameters() lacks ignored ones"
        for unit in units_of(wrapped):
            assert unit.module is not ignored, "a unit wraps the ignored module"
            held = {id(o()) for f in unit.flat_params for o in f.original_refs}
            assert not held & {id(p) for p in self.params}, f"unit {unit.name} flattened one"
        return wrapped

    def between_steps(self, model: nn.Module, ref: nn.Module, step: int) -> None:
        _same_on_every_rank(f"ignored parameters after step {step}", self.params)
        for p, before in zip(
            [p for p in self.params if not p.requires_grad], self.frozen_values, strict=True
        ):
            assert torch.equal(p.detach(), before), "a frozen ignored parameter changed"


def _sgd(model: nn.Module) -> list[torch.optim.Optimizer]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [torch.optim.SGD(params, lr=0.05, momentum=0.9)]


def _train(
    name: str,
    pick,
    *,
    make_model=untied_gpt,
    as_params: bool = False,
    tol=FP32,
    wrap_kwargs: dict | None = None,
    **run_kwargs,
):
    wrap = _Ignoring(pick, as_params=as_params, **(wrap_kwargs or {}))
    world = dist.get_world_size()
    run = Run(
        name=name,
        make_model=make_model,
        batch=functools.partial(token_batch, world),
        loss=gpt_loss,
        wrap=wrap,
        tol=tol,
        steps=4,
        between_steps=wrap.between_steps,
        **run_kwargs,
    )
    return functools.partial(compare_training, run)


def _frozen_head_gpt() -> nn.Module:
    model = untied_gpt()
    model.lm_head.requires_grad_(False)
    return model


def _check_mixed_precision_keeps_dtypes() -> None:
    torch.manual_seed(0)
    model = fp32_head_gpt()
    mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model.blocks[0].register_buffer("shift", torch.zeros(()))
    wrapped = fsdp_lite.FSDPModule(
        model, auto_wrap_policy=BLOCKS, mixed_precision=mp, ignored_modules=[model.lm_head]
    )
    assert model.lm_head.scale.dtype == torch.float32, "an ignored buffer was cast"
    assert model.blocks[0].module.shift.dtype == torch.bfloat16, "a unit's buffer was not cast"
    x, y = token_batch(dist.get_world_size(), 0)
    logits, loss = wrapped(x, y)
    assert logits.dtype == torch.float32
    loss.backward()
    assert model.lm_head.proj.weight.grad.dtype == torch.float32


def _check_errors() -> None:
    torch.manual_seed(0)
    model = untied_gpt()
    with pytest.raises(ValueError, match="not a submodule of the wrapped GPT"):
        fsdp_lite.FSDPModule(model, ignored_modules=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="the module being wrapped"):
        fsdp_lite.FSDPModule(model, ignored_modules=[model])
    with pytest.raises(TypeError, match="ignored_modules takes an iterable"):
        fsdp_lite.FSDPModule(model, ignored_modules=model.lm_head)
    with pytest.raises(ValueError, match="ignored_params: a parameter of shape"):
        fsdp_lite.FSDPModule(model, ignored_params={nn.Parameter(torch.zeros(3))})
    tied = gpt()  # lm_head.weight is wte.weight
    with pytest.raises(ValueError, match=r"'lm_head.weight' of an ignored module is tied to "
                       r"'wte.weight'"):  # fmt: skip
        fsdp_lite.FSDPModule(tied, auto_wrap_policy=BLOCKS, ignored_modules=[tied.lm_head])
    meta = untied_gpt()
    meta.lm_head = Linear(32, 64, bias=False, device="meta")
    with pytest.raises(RuntimeError, match="ignored module 'lm_head' .* is on the meta device"):
        fsdp_lite.FSDPModule(meta, auto_wrap_policy=BLOCKS, ignored_modules=[meta.lm_head])
    for m in (model, tied, meta):  # refused before anything changed: still wrappable
        assert not any(replicated_ranks(p) is not None for p in m.parameters())
        assert all(p.numel() > 0 for p in m.parameters() if not p.is_meta)
    fsdp_lite.FSDPModule(model, auto_wrap_policy=BLOCKS)


def _check_replicas_must_agree() -> None:
    """Ignored parameters that differ across ranks at the first forward are refused;
    sync_module_states=True broadcasts rank 0's at wrap time."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = token_batch(world, 0)
    for sync in (False, True):
        torch.manual_seed(0)
        model = untied_gpt()
        with torch.no_grad():
            model.lm_head.weight.add_(rank)
        wrapped = fsdp_lite.FSDPModule(
            model, auto_wrap_policy=BLOCKS, ignored_modules=[model.lm_head],
            sync_module_states=sync,
        )  # fmt: skip
        if not sync:
            with pytest.raises(ValueError, match="holds different values on different ranks"):
                wrapped(x, y)
            continue
        wrapped(x, y)[1].backward()
        _same_on_every_rank("a synced head", [model.lm_head.weight])


def _check_partial_backward_is_averaged() -> None:
    """A loss through the ignored head alone (called outside the model's forward, no unit in
    the backward) still has its gradient averaged."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = untied_gpt()
    wrapped = fsdp_lite.FSDPModule(model, auto_wrap_policy=BLOCKS, ignored_modules=[model.lm_head])
    x, y = token_batch(world, 0)
    wrapped(x, y)[1].backward()  # the root exists
    head = model.lm_head
    head.weight.grad = None
    inputs = [torch.full((3, 32), float(r + 1)) for r in range(world)]
    head(inputs[rank]).sum().backward()
    want = sum(torch.ones(64, 3) @ i for i in inputs) / world
    torch.testing.assert_close(head.weight.grad, want)
    with wrapped.no_sync():  # not averaged inside no_sync
        head.weight.grad = None
        head(inputs[rank]).sum().backward()
        torch.testing.assert_close(head.weight.grad, torch.ones(64, 3) @ inputs[rank])


def _check_ddp_owned_head() -> None:
    """A head owned by DistributedDataParallel: DDP averages it, fsdp_lite leaves it alone,
    and the optimizer accepts it."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = untied_gpt()
    model = copy.deepcopy(ref)
    model.lm_head = nn.parallel.DistributedDataParallel(model.lm_head)
    wrapped = fsdp_lite.FSDPModule(model, auto_wrap_policy=BLOCKS, ignored_modules=[model.lm_head])
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x, y = token_batch(world, 0)
    ref(x, y)[1].backward()
    wrapped(*(t.chunk(world)[dist.get_rank()] for t in (x, y)))[1].backward()
    assert wrapped._unit.root.replicas.averaged == [], "fsdp_lite averages DDP's parameters"
    torch.testing.assert_close(
        model.lm_head.module.weight.grad, ref.lm_head.weight.grad, rtol=1e-4, atol=1e-7
    )
    opt.step()


class TwoHeads(nn.Module):
    """A body and two same-shaped heads; ``which`` picks the head (data-dependent)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, which: int) -> torch.Tensor:
        return (self.a if which == 0 else self.b)(self.body(x))


def _check_ranks_disagree_on_used_heads() -> None:
    """Ranks whose backwards reached different ignored parameters (of the same sizes) are
    refused, never averaged into each other."""
    torch.manual_seed(0)
    model = TwoHeads()
    wrapped = fsdp_lite.FSDPModule(model, ignored_modules=[model.a, model.b])
    x = torch.ones(2, 8)
    wrapped(x, 0).sum().backward()  # the same head everywhere: fine
    _same_on_every_rank("head a's gradient", [model.a.weight.grad])
    wrapped.zero_grad(set_to_none=True)  # rank 0 then holds a's 72 elements, rank 1 b's
    with pytest.raises(fsdp_lite.DivergenceError, match=r"2 of 4 with a gradient"):
        wrapped(x, dist.get_rank()).sum().backward()


def _cases(rank: int, world: int) -> dict:
    mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16)
    hybrid = fsdp_lite.hybrid_groups(1)  # shard over 1 rank, replicate over 2
    cases = [
        ("head ignored, AdamW", _train("head AdamW", _head)),
        ("head ignored, SGD momentum", _train("head SGD", _head, optimizers=_sgd)),
        (
            "middle block ignored, AdamW",
            _train("middle block", _middle, make_model=functools.partial(untied_gpt, n_layer=3)),
        ),
        ("head as ignored_params", _train("ignored_params", _head, as_params=True)),
        ("frozen ignored head", _train("frozen head", _head, make_model=_frozen_head_gpt)),
        (
            "head ignored, no_sync accumulation",
            _train("accumulation", _head, accumulate=2, optimizers=_sgd),
        ),
        ("head ignored, clip_grad_norm_", _train("clip", _head, clip=0.05)),
        (
            "fp32 head ignored, bf16 mixed precision",
            _train(
                "bf16",
                _head,
                make_model=fp32_head_gpt,
                tol=BF16,
                wrap_kwargs={"mixed_precision": mp},
            ),
        ),  # fmt: skip
        (
            "head ignored, reshard_after_forward=False",
            _train("raf False", _head, wrap_kwargs={"reshard_after_forward": False}),
        ),
        ("mixed precision: ignored buffers keep their dtype", _check_mixed_precision_keeps_dtypes),
        ("errors: outside the model, tied, meta, bad types", _check_errors),
        ("replicas must start equal; sync_module_states", _check_replicas_must_agree),
        (
            "a backward through the ignored head alone is averaged",
            _check_partial_backward_is_averaged,
        ),
        ("a DDP-owned head is left to DDP", _check_ddp_owned_head),
        (
            "hybrid sharding (1 x 2), head ignored",
            _train("hybrid", _head, wrap_kwargs={"process_group": hybrid}),
        ),
        # Last: it leaves a backward that raised.
        ("ranks that reach different ignored heads: refused", _check_ranks_disagree_on_used_heads),
    ]
    return run_subtests(cases)


def test_ignored_modules() -> None:
    assert_subtests_passed(run_distributed(_cases, 2, timeout=300))
