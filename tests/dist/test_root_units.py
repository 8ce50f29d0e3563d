"""The embedding and the head as units of their own (``wrap.embeddings_and_head``), so the
root holds little more than the final norm: each case against the single-process reference.

- untied GPT (fp32, bf16, gradient accumulation under no_sync, the user's ``save_on_cpu``)
  and HF Llama (with and without HF's layer checkpointing): by the time the last block's
  backward starts, the head's unit has freed its full parameters (its location holds a
  ``FreedParameter``) and sent its gradient off, so neither waits beside the blocks'
  backward;
- a tied GPT and a tied Llama: the policy gives neither end a unit, the shared weight stays
  in the root, which trains like the reference;
- a root module run under ``torch.utils.checkpoint`` before the blocks (its recompute reads
  the root's weights at the end of backward) trains like the reference;
- the policies refuse what they cannot place, with a message naming the way out.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from cases import PRECISIONS, gpt, gpt_loss, gpt_run
from hf_cases import hf_run, llama
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_lite import FSDPModule
from fsdp_lite.build import wrap
from fsdp_lite.core.freed import FreedParameter
from fsdp_lite.core.tree import unit_of, units_of, unwrap
from fsdp_lite.testing import GPT, GPTConfig, run_distributed
from fsdp_lite.testing.models import Block
from fsdp_lite.testing.reference import compare_training
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests


def _wrap_ends(blocks, model: nn.Module, mixed_precision=None) -> FSDPModule:
    policy = wrap.any_of(wrap.by_type(*blocks(model)), wrap.embeddings_and_head(model))
    return FSDPModule(model, auto_wrap_policy=policy, mixed_precision=mixed_precision)


def _gpt_blocks(model: nn.Module) -> tuple[type, ...]:
    return (Block,)


def _llama_blocks(model: nn.Module) -> tuple[type, ...]:
    return wrap.transformer_layers(model)


class _Observer:
    """Wraps a loss function: on the wrapped model, a gradient hook on the last block's
    input records, as that block's backward ends, whether the head's unit is freed and
    done (its gradient sent: POST_BACKWARD)."""

    def __init__(self, loss, last_block) -> None:
        self.loss, self.last_block = loss, last_block
        self.seen: list[tuple[bool, bool, str]] = []

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        if isinstance(model, FSDPModule):
            handle = self.last_block(model.module).register_forward_pre_hook(self._hook(model))
            try:
                return self.loss(model, batch)
            finally:
                handle.remove()
        return self.loss(model, batch)

    def _hook(self, model: FSDPModule):
        def pre_hook(module, args):
            if args[0].requires_grad:
                args[0].register_hook(functools.partial(self._record, model))

        return pre_hook

    def _record(self, model: FSDPModule, grad: torch.Tensor) -> None:
        head = model.module.get_output_embeddings()
        unit = unit_of(head)
        weight = unwrap(head).__dict__.get("weight")
        freed = not any(f.is_unsharded for f in unit.flat_params)
        self.seen.append((freed, isinstance(weight, FreedParameter), unit.state.name))

    def check(self, backwards: int) -> None:
        assert len(self.seen) == backwards, self.seen
        assert all(s == (True, True, "POST_BACKWARD") for s in self.seen), self.seen


def _save_on_cpu_loss(model: nn.Module, batch) -> torch.Tensor:
    with torch.autograd.graph.save_on_cpu():
        return gpt_loss(model, batch)


def _gpt_ends_run(name: str, world: int, precision: str = "fp32", **kw):
    mp = PRECISIONS[precision][0]
    wrap_fn = functools.partial(_wrap_ends, _gpt_blocks, mixed_precision=mp)
    return gpt_run(name, world, precision, wrap=wrap_fn, **kw)


def _observed_runs(world: int) -> list:
    untied = functools.partial(gpt, tie_weights=False)
    last_gpt = lambda m: m.blocks[-1]  # noqa: E731
    out = []
    for name, precision, kw, loss in [
        ("gpt untied", "fp32", {}, gpt_loss),
        ("gpt untied", "bf16", {}, gpt_loss),
        ("gpt untied no_sync x2", "fp32", dict(accumulate=2), gpt_loss),
        ("gpt untied save_on_cpu", "fp32", {}, _save_on_cpu_loss),
    ]:
        observer = _Observer(loss, last_gpt)
        run = _gpt_ends_run(name, world, precision, make_model=untied, loss=observer, **kw)
        out.append((run, observer))
    for name, make in [
        ("llama", llama),
        ("llama hf-checkpointing", functools.partial(llama, checkpointing=True)),
    ]:
        observer = _Observer(None, lambda m: m.model.layers[-1])
        run = hf_run(name, world, make, wrap=functools.partial(_wrap_ends, _llama_blocks))
        observer.loss, run.loss = run.loss, observer
        out.append((run, observer))
    return out


class ProjectedGPT(GPT):
    """A GPT whose root runs a projection of the embeddings under torch.utils.checkpoint,
    before the blocks: its recompute, at the end of backward, reads the root's weights."""

    def __init__(self) -> None:
        super().__init__(GPTConfig())
        self.proj = nn.Linear(self.cfg.n_embd, self.cfg.n_embd)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        x = checkpoint(self.proj, x, use_reentrant=False)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def _tied_runs(world: int) -> list:
    def no_end_units(run):
        def check(wrapped: nn.Module, reference: nn.Module) -> None:
            inner = wrapped.module
            ends = (inner.get_input_embeddings(), inner.get_output_embeddings())
            assert all(unit_of(m) is None for m in ends), "a tied end got a unit"

        run.before_training = check
        return run

    tied_llama = hf_run(
        "llama tied", world, functools.partial(llama, tie=True),
        wrap=functools.partial(_wrap_ends, _llama_blocks),
    )  # fmt: skip
    return [
        no_end_units(_gpt_ends_run("gpt tied", world)),
        no_end_units(tied_llama),
        _gpt_ends_run("checkpointed root module", world, make_model=ProjectedGPT),
    ]


def _cases(rank: int, world: int) -> dict:
    def observed(run, observer) -> None:
        compare_training(run)
        observer.check(run.steps * run.accumulate)

    cases = [
        (run.name, functools.partial(observed, run, observer))
        for run, observer in _observed_runs(world)
    ]
    cases += [(run.name, functools.partial(compare_training, run)) for run in _tied_runs(world)]
    return run_subtests(cases)


def test_embedding_and_head_units_match_reference() -> None:
    assert_subtests_passed(run_distributed(_cases, 2, timeout=300.0))


def test_policies_refuse_what_they_cannot_place() -> None:
    with pytest.raises(TypeError, match="wrap.instances"):
        wrap.instances()
    with pytest.raises(TypeError, match="nn.Module objects"):
        wrap.instances("lm_head")
    bare = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))
    with pytest.raises(TypeError, match=r"wrap.instances\(model.embed"):
        wrap.embeddings_and_head(bare)


def test_instances_picks_exactly_the_named_modules() -> None:
    model = gpt(tie_weights=False)
    policy = wrap.instances(model.wte, model.lm_head)
    picked = [n for n, m in model.named_modules() if policy(m)]
    assert picked == ["wte", "lm_head"]
    tied = gpt()
    assert not [m for m in tied.modules() if wrap.embeddings_and_head(tied)(m)]


def test_a_module_holding_only_a_tie_gets_no_unit(world1) -> None:
    model = gpt()  # lm_head.weight is wte.weight
    wrapped = FSDPModule(model, auto_wrap_policy=wrap.instances(model.lm_head, model.wte))
    assert len(units_of(wrapped)) == 1  # the root alone: both ends hold only the tie
    x = torch.randint(0, 64, (2, 16))
    wrapped(x, x)[1].backward()
    assert all(p.grad is not None for p in wrapped.parameters())
