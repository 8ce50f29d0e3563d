"""Compiled blocks (``fsdp_lite.compile_blocks``, inductor on CPU) inside fsdp_lite units.

Each case trains W=2 compiled-block units beside the single-process *eager* reference
(``compare_training``: losses every step, gradients, final parameters and the state-dict
keys), counting dynamo's graph compiles with a counting backend around inductor: one
graph for every block of a class, compiled in the first step and never again (no
recompile when each forward installs new parameter views). All cases run in one spawn;
dynamo is reset between them.
"""

from __future__ import annotations

import copy
import functools
import inspect
import time
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from cases import PRECISIONS, gpt, gpt_run, token_batch, wrap_blocks
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import fsdp_lite
from fsdp_lite.addons.compile import is_compiled
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.models import MLP, Block
from fsdp_lite.testing.reference import Run, compare_training
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests

STEPS = 5


def _train_compiled(run: Run, compile_and_wrap: Callable, counter: CompileCounterWithBackend):
    """``compare_training`` with ``run.wrap = compile_and_wrap``; then check the graph count
    (1, from the first step on), that no graph broke, and that every unit below the root
    wraps a compiled block (the policy by block type still matched)."""
    graphs: list[int] = []
    wrapped: list[fsdp_lite.FSDPModule] = []

    def wrap(module: torch.nn.Module) -> fsdp_lite.FSDPModule:
        wrapped.append(compile_and_wrap(module))
        return wrapped[-1]

    run.wrap = wrap
    run.between_steps = lambda model, ref, step: graphs.append(counter.frame_count)
    compare_training(run)
    assert graphs == [1] * run.steps, f"graphs compiled after each step: {graphs}"
    assert not counters["graph_break"], dict(counters["graph_break"])
    inner = [u.module for u in units_of(wrapped[0])[1:]]
    assert len(inner) == 2 and all(is_compiled(fsdp_lite.core.tree.unwrap(m)) for m in inner), inner


def _gpt_case(precision: str, world: int, checkpointing: bool = False) -> None:
    counter = CompileCounterWithBackend("inductor")
    mp = PRECISIONS[precision][0]

    def compile_and_wrap(module: torch.nn.Module) -> fsdp_lite.FSDPModule:
        assert fsdp_lite.compile_blocks(module, Block, backend=counter) == ["blocks.0", "blocks.1"]
        if not checkpointing:
            return wrap_blocks(module, mixed_precision=mp)
        fsdp_lite.apply_activation_checkpointing(module, fsdp_lite.wrap.by_type(Block))
        policy = fsdp_lite.wrap.by_type(fsdp_lite.CheckpointWrapper)
        return fsdp_lite.FSDPModule(module, auto_wrap_policy=policy, mixed_precision=mp)

    run = gpt_run(f"compiled ac={checkpointing}", world, precision, steps=STEPS)
    _train_compiled(run, compile_and_wrap, counter)


def _llama_case(world: int) -> None:
    """HF Llama decoder layers (RoPE, GQA, RMSNorm, ModelOutput), fullgraph."""
    import hf_cases

    counter = CompileCounterWithBackend("inductor")

    def compile_and_wrap(model: torch.nn.Module) -> fsdp_lite.FSDPModule:
        layers = fsdp_lite.wrap.transformer_layers(model)
        fsdp_lite.compile_blocks(model, layers, backend=counter)
        return hf_cases.wrap_layers(model)

    run = hf_cases.hf_run("compiled llama", world, hf_cases.llama, steps=STEPS)
    _train_compiled(run, compile_and_wrap, counter)


def _misuse_case(world: int) -> None:
    """Compiling after wrapping is refused, and so is a mode that captures CUDA graphs; a
    unit inside a compiled block is named at the first forward (its hooks cannot be
    traced), before any of its collectives."""
    model = fsdp_lite.FSDPModule(gpt(), auto_wrap_policy=fsdp_lite.wrap.by_type(Block))
    wrapped = r"the model already holds an FSDPModule unit \(the model itself\); compile the"
    with pytest.raises(ValueError, match=wrapped + " blocks before wrapping the model"):
        fsdp_lite.compile_blocks(model, Block)
    with pytest.raises(ValueError, match="picks no module of GPT"):
        fsdp_lite.compile_blocks(gpt(), torch.nn.Conv2d)
    for graphs in ({"mode": "reduce-overhead"}, {"mode": "max-autotune"},
                   {"options": {"triton.cudagraphs": True}}):  # fmt: skip
        with pytest.raises(ValueError, match="captures CUDA graphs"):
            fsdp_lite.compile_blocks(gpt(), Block, **graphs)
    inner = gpt()
    fsdp_lite.compile_blocks(inner, Block, backend="eager")
    with pytest.raises(ValueError, match="compiled already"):
        fsdp_lite.compile_blocks(inner, Block)
    model = fsdp_lite.FSDPModule(inner, auto_wrap_policy=fsdp_lite.wrap.by_type(MLP))
    with pytest.raises(ValueError, match=r"the compiled Block holds the unit\(s\) mlp"):
        model(*token_batch(1, 0))


def _deepcopy_case(world: int) -> None:
    """A deep copy of a compiled model runs its own blocks (the compiled forward is bound to
    each block, not captured from the original) and keeps the block's signature; wrapped,
    it trains like the original wrapped."""
    original = gpt()
    fsdp_lite.compile_blocks(original, Block, backend="eager")
    twin = copy.deepcopy(original)
    assert twin.blocks[0].forward.__self__ is twin.blocks[0]
    assert list(inspect.signature(twin.blocks[0].forward).parameters) == ["x"]
    with torch.no_grad():
        for p in twin.blocks[1].parameters():
            p.zero_()  # the second block adds nothing: twin's output differs from original's
    x = torch.randn(2, 16, 32)
    assert torch.equal(twin.blocks[1](x), x)
    assert not torch.equal(original.blocks[1](x), x)
    losses = []
    for model in (original, twin):
        wrapped = wrap_blocks(model)
        losses.append(wrapped(*token_batch(world, 0))[1].item())
    assert losses[0] != losses[1], losses


def _standard_compile_case(how: str, world: int) -> None:
    """torch's own APIs: ``block.compile()`` before or after wrapping, ``torch.compile`` of
    the wrapped model. fsdp_lite's hooks are never traced (they run eagerly around the
    compiled region): the blocks' math is one graph, compiled in the first step and never
    again, and the only graph breaks are the skipped hooks at a unit's boundary."""
    counter = CompileCounterWithBackend("eager")

    def wrap(module: torch.nn.Module) -> fsdp_lite.FSDPModule:
        if how == "block.compile() before wrapping":
            for block in module.blocks:
                block.compile(backend=counter)
        model = wrap_blocks(module)
        if how == "block.compile() after wrapping":
            for block in model.module.blocks:
                block.compile(backend=counter)
        if how == "torch.compile(model) after wrapping":
            model.__dict__["compiled"] = torch.compile(model, backend=counter)
        return model

    def loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        return model.__dict__.get("compiled", model)(*batch)[1]

    graphs: list[int] = []
    run = gpt_run(how, world, "fp32", steps=STEPS)
    run.wrap, run.loss = wrap, loss
    run.between_steps = lambda model, ref, step: graphs.append(counter.frame_count)
    compare_training(run)
    assert graphs == [1] * run.steps, f"graphs compiled after each step: {graphs}"
    assert counter.op_count > 0, "nothing of the blocks was compiled"
    breaks = {k: v for k, v in counters["graph_break"].items() if "disable()" not in k}
    assert not breaks, f"graph breaks other than the skipped hooks: {breaks}"


def _cases(rank: int, world: int) -> dict[str, str | None]:
    times: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], None]) -> tuple[str, Callable[[], None]]:
        def case() -> None:
            torch._dynamo.reset()
            counters.clear()
            start = time.perf_counter()
            try:
                fn()
            finally:
                times[name] = time.perf_counter() - start

        return name, case

    results = run_subtests(
        [
            timed("gpt fp32 compiled blocks = eager reference", lambda: _gpt_case("fp32", world)),
            timed("gpt bf16 compiled blocks = eager reference", lambda: _gpt_case("bf16", world)),
            timed("gpt fp32 compiled + checkpointed", lambda: _gpt_case("fp32", world, True)),
            timed("llama fp32 compiled decoder layers", lambda: _llama_case(world)),
            timed("deep copy of a compiled model", lambda: _deepcopy_case(world)),
            timed("compile after wrapping, unit inside a block", lambda: _misuse_case(world)),
            *(
                timed(how, functools.partial(_standard_compile_case, how, world))
                for how in (
                    "block.compile() before wrapping",
                    "block.compile() after wrapping",
                    "torch.compile(model) after wrapping",
                )
            ),
        ]
    )
    if rank == 0:
        print({k: round(v, 1) for k, v in times.items()})
    return results


def test_compiled_blocks_train_like_eager_without_recompiles() -> None:
    assert_subtests_passed(run_distributed(_cases, 2, timeout=300))
