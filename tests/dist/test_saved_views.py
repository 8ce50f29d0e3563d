"""The root's full parameters are freed inside backward once nothing autograd saved reads
them (fsdp_lite/saved_views.py), each case against the single-process reference:

- by the time the last block's backward is over, the root's full buffers are freed and its
  parameter locations hold a ``FreedParameter`` (tied GPT fp32/bf16, untied GPT, HF Llama
  with and without HF's layer checkpointing, the user's ``save_on_cpu`` around forward);
- a root module run under ``torch.utils.checkpoint`` before the blocks (its recompute reads
  the root's parameters after they are freed) raises an error naming the unit and the way
  out, ``reshard_after_forward=False``, which then trains like the reference.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from cases import gpt, gpt_loss, gpt_run, token_batch, wrap_blocks
from hf_cases import hf_run, llama
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_lite import FSDPModule
from fsdp_lite.flat_param import FreedParameter
from fsdp_lite.testing import GPT, GPTConfig, run_distributed
from fsdp_lite.testing.reference import compare_training
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests


class _Observer:
    """Wraps a loss function: on the wrapped model, a gradient hook on the last block's
    input records, after that block's backward, whether the root's full buffers are freed
    and what its parameter locations hold."""

    def __init__(self, loss, blocks, head) -> None:
        self.loss, self.blocks, self.head = loss, blocks, head
        self.seen: list[tuple[bool, bool]] = []

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        if isinstance(model, FSDPModule):
            last = self.blocks(model.module)[-1]
            handle = last.register_forward_pre_hook(self._hook_input(model))
            try:
                return self.loss(model, batch)
            finally:
                handle.remove()
        return self.loss(model, batch)

    def _hook_input(self, model: FSDPModule):
        def pre_hook(module, args):
            x = args[0]
            if x.requires_grad:
                x.register_hook(functools.partial(self._record, model))

        return pre_hook

    def _record(self, model: FSDPModule, grad: torch.Tensor) -> None:
        freed = not any(f.is_unsharded for f in model._unit.flat_params)
        self.seen.append((freed, isinstance(self.head(model.module), FreedParameter)))

    def check(self, steps: int) -> None:
        assert len(self.seen) == steps, self.seen
        assert all(s == (True, True) for s in self.seen), self.seen


def _gpt_blocks(m: nn.Module):
    return m.blocks


def _gpt_head(m: nn.Module):
    return m.lm_head.__dict__.get("weight", m.lm_head.weight)


def _llama_blocks(m: nn.Module):
    return m.model.layers


def _llama_head(m: nn.Module):
    return m.lm_head.__dict__.get("weight", m.lm_head.weight)


def _save_on_cpu_loss(model: nn.Module, batch) -> torch.Tensor:
    with torch.autograd.graph.save_on_cpu():
        return gpt_loss(model, batch)


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


def _observed_runs(world: int) -> list:
    out = []
    cases = [
        ("gpt tied", gpt_run, dict(make_model=gpt), gpt_loss, _gpt_blocks, _gpt_head),
        ("gpt tied", gpt_run, dict(precision="bf16"), gpt_loss, _gpt_blocks, _gpt_head),
        (
            "gpt untied",
            gpt_run,
            dict(make_model=functools.partial(gpt, tie_weights=False)),
            gpt_loss,
            _gpt_blocks,
            _gpt_head,
        ),
        ("gpt save_on_cpu", gpt_run, {}, _save_on_cpu_loss, _gpt_blocks, _gpt_head),
    ]
    for name, make_run, kw, loss, blocks, head in cases:
        observer = _Observer(loss, blocks, head)
        out.append((make_run(name, world, loss=observer, **kw), observer))
    for name, make in [
        ("llama", llama),
        ("llama hf-checkpointing", functools.partial(llama, checkpointing=True)),
    ]:
        observer = _Observer(None, _llama_blocks, _llama_head)
        run = hf_run(name, world, make)
        observer.loss, run.loss = run.loss, observer
        out.append((run, observer))
    return out


def _checkpointed_root_refused(world: int) -> str:
    torch.manual_seed(0)
    model = wrap_blocks(ProjectedGPT())
    x, y = (t.chunk(world)[torch.distributed.get_rank()] for t in token_batch(world, 0))
    _, loss = model(x, y)
    with pytest.raises(RuntimeError, match="reshard_after_forward=False") as info:
        loss.backward()
    assert "<root ProjectedGPT>" in str(info.value), info.value
    return str(info.value).splitlines()[0][:160]


def _cases(rank: int, world: int) -> dict:
    def observed(run, observer) -> None:
        compare_training(run)
        observer.check(run.steps * run.accumulate)

    cases = [
        (run.name, functools.partial(observed, run, observer))
        for run, observer in _observed_runs(world)
    ]
    kept = gpt_run(
        "checkpointed root, reshard_after_forward=False",
        world,
        raf=False,
        make_model=ProjectedGPT,
    )
    cases += [
        (kept.name, functools.partial(compare_training, kept)),
        ("checkpointed root refused", lambda: _checkpointed_root_refused(world)),
    ]
    return run_subtests(cases)


def test_root_freed_inside_backward_matches_reference() -> None:
    assert_subtests_passed(run_distributed(_cases, 2, timeout=300.0))
