"""Hugging Face models through fsdp_lite, each case against the single-process reference
(the same model unwrapped, same seed, trained on the global batch; W=2, gloo).

Training: Llama (GQA, RoPE; tied and untied head), GPT-2 (Conv1D), Qwen2 (q/k/v biases),
fp32 and bf16, Llama with HF gradient checkpointing, PEFT LoRA on a frozen base, and a
root whose forward returns a dataclass, a NamedTuple or an HF ModelOutput.
Call paths other than the wrapper's forward: eval/no_grad and inference_mode forwards,
``generate()`` with a KV cache, a direct call of the inner module, the inner module's
``state_dict()`` and ``save_pretrained()``. Each is followed by training steps that must
still match the reference.

Every case runs and is reported by name; one AssertionError lists all that failed.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist
from hf_cases import (
    HF_MODELS,
    OUTPUT_TYPES,
    hf_loss,
    hf_run,
    llama,
    local_tokens,
    lora_llama,
    output_run,
    wrap_layers,
)
from peft import get_peft_model_state_dict
from transformers import LlamaForCausalLM

import fsdp_lite
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import compare_training
from fsdp_lite.testing.subtests import (
    agree,
    assert_subtests_passed,
    run_subtests,
)

WORLD = 2
STEPS = 5
LOGITS_ATOL = 1e-5  # fp32 throughout: the wrapper computes what the reference computes


# -- checks (each raises AssertionError on every rank if it fails on any) ---------------


def _close(what: str, got: torch.Tensor, want: torch.Tensor, atol: float = LOGITS_ATOL) -> None:
    def check() -> None:
        if got.shape != want.shape:
            raise AssertionError(f"shape {tuple(got.shape)} vs reference {tuple(want.shape)}")
        diff = (got.detach().float() - want.detach().float()).abs().max().item()
        if not diff <= atol:
            raise AssertionError(f"max |diff| {diff:.3g} > {atol}")

    agree(what, check)


def _same_state_dict(what: str, got: dict, want: dict) -> None:
    def check() -> None:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing or extra:
            raise AssertionError(f"missing keys {missing[:4]}, unexpected keys {extra[:4]}")
        for key, value in want.items():
            if got[key].shape != value.shape:
                raise AssertionError(f"{key}: shape {tuple(got[key].shape)} vs {value.shape}")
            diff = (got[key].float() - value.float()).abs().max().item()
            if not diff <= 1e-5:
                raise AssertionError(f"{key} differs by {diff:.3g}")

    agree(what, check)


def _full_bytes_now(model) -> int:
    return fsdp_lite.stats(model)["full_bytes_now"]


def _at(steps: tuple[int, ...], fn):
    """A ``between_steps`` hook that runs ``fn(model, ref, step)`` after the given steps."""

    def hook(model, ref, step: int) -> None:
        if step in steps or (step - STEPS) in steps:  # -1: the last step
            fn(model, ref, step)

    return hook


# -- inference through the wrapper --------------------------------------------------


def _eval_no_grad_forward(model, ref, step: int) -> None:
    """eval() + no_grad(): the wrapper's logits are the reference's; nothing stays gathered."""
    x = local_tokens(step)
    before = _full_bytes_now(model)
    model.eval()
    ref.eval()
    with torch.no_grad():
        got, want = model(input_ids=x).logits, ref(input_ids=x).logits
    model.train()
    ref.train()
    _close("eval no_grad logits", got, want)
    after = _full_bytes_now(model)
    agree("full params freed", lambda: _equal(after, before, "gathered bytes after the forward"))


def _equal(got, want, what: str) -> None:
    if got != want:
        raise AssertionError(f"{what}: {got} vs {want}")


def _inference_mode_forward(model, ref) -> None:
    """inference_mode as the wrapped model's very first forward (lazy init runs inside it)."""
    x = local_tokens(-1)
    with torch.inference_mode():
        got, want = model(input_ids=x).logits, ref(input_ids=x).logits
    _close("inference_mode logits", got, want)


def _generate(model, ref, step: int = -1) -> None:
    """Greedy generate() with HF's KV cache: exactly the reference's tokens."""
    x = local_tokens(step)
    kwargs = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(x))
    model.eval()
    ref.eval()
    got, want = model.generate(x, **kwargs), ref.generate(x, **kwargs)
    model.train()
    ref.train()
    agree("generated tokens", lambda: _equal(got.tolist(), want.tolist(), "tokens"))


def _inner_module_call(model, ref, step: int = -1) -> None:
    """``model.module(input_ids=x)`` (bypassing the wrapper's forward) computes the
    reference's logits."""
    x = local_tokens(step)
    with torch.no_grad():
        got, want = model.module(input_ids=x).logits, ref(input_ids=x).logits
    _close("inner module logits", got, want)


# -- HF-format state dicts through the inner module -----------------------------------


def _inner_state_dict(model, ref, step: int) -> None:
    """``model.module.state_dict()`` on every rank: the reference's full state dict (same
    keys, the root's own parameters included)."""
    got = model.module.state_dict()
    _same_state_dict("module.state_dict()", got, ref.state_dict())


def _save_pretrained_roundtrip(model, ref, step: int) -> None:
    """``model.module.save_pretrained(d)`` on every rank (transformers writes on rank 0),
    then ``from_pretrained(d)`` on every rank: the reference's logits."""
    x = local_tokens(step)
    with _shared_tmpdir() as d:
        model.module.save_pretrained(d)
        dist.barrier()  # rank 0 has written the files
        loaded = LlamaForCausalLM.from_pretrained(d, attn_implementation="eager")
    with torch.no_grad():
        got, want = loaded(input_ids=x).logits, ref(input_ids=x).logits
    _close("from_pretrained logits", got, want)


@contextlib.contextmanager
def _shared_tmpdir() -> Iterator[str]:
    """One temporary directory for all ranks (one machine), removed once all are done."""
    path = [tempfile.mkdtemp(prefix="fsdp_lite_hf_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    try:
        yield path[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


# -- PEFT ----------------------------------------------------------------------------


def _adapter_state_matches(model, ref, step: int) -> None:
    """``get_peft_model_state_dict(wrapped)`` on every rank: the reference's adapter."""
    got, want = get_peft_model_state_dict(model), get_peft_model_state_dict(ref)
    agree("adapter keys", lambda: _equal(len(want) > 0, True, "adapter weights exist"))
    _same_state_dict("get_peft_model_state_dict", got, want)


# -- the two spawns -----------------------------------------------------------------


def _training_cases(rank: int, world: int) -> dict[str, str | None]:
    runs = [
        hf_run(name, world, make, precision, steps=STEPS)
        for name, make in HF_MODELS.items()
        for precision in ("fp32", "bf16")
    ]
    runs += [
        hf_run(
            "llama gradient checkpointing",
            world,
            functools.partial(llama, checkpointing=True),
            steps=STEPS,
        ),
        hf_run(
            "peft lora llama, frozen base",
            world,
            lora_llama,
            steps=STEPS,
            between_steps=_at((-1,), _adapter_state_matches),
        ),
    ]
    runs += [output_run(kind, world) for kind in OUTPUT_TYPES]
    cases = [(run.name, functools.partial(compare_training, run)) for run in runs]
    for ckpt in (False, True):
        name = f"lora: frozen base frees in backward like full training (checkpointing={ckpt})"
        cases.append((name, functools.partial(_frozen_base_frees_like_full, ckpt)))
    return run_subtests(cases)


def _backward_gathered_units(make_model) -> int:
    """Most units holding full parameters at once during one backward (second step)."""
    torch.manual_seed(0)
    model = wrap_layers(make_model())
    for _ in range(2):
        loss = hf_loss(model, (local_tokens(0), local_tokens(0)))
        fsdp_lite.reset_stats(model)  # live allocations carry over: the peak starts from now
        loss.backward()
    return fsdp_lite.stats(model)["unsharded_units_peak"]


def _frozen_base_frees_like_full(checkpointing: bool) -> None:
    """A frozen base (LoRA) holds no more gathered units in backward than full training:
    each unit frees its frozen flat param once its backward is over, not at the end."""
    full = _backward_gathered_units(functools.partial(llama, layers=6, checkpointing=checkpointing))
    lora = _backward_gathered_units(
        functools.partial(lora_llama, layers=6, checkpointing=checkpointing)
    )
    agree("gathered units", lambda: _equal(lora <= full, True, f"lora {lora} vs full {full}"))


def _call_path_cases(rank: int, world: int) -> dict[str, str | None]:
    tied = functools.partial(llama, tie=True)
    runs = [
        hf_run("eval + no_grad forward after every step", world, tied,
               between_steps=_eval_no_grad_forward),
        hf_run("inference_mode as the first forward", world, tied,
               before_training=_inference_mode_forward),
        hf_run("generate before training and after step 1", world, tied,
               before_training=_generate, between_steps=_at((1,), _generate)),
        hf_run("inner module called directly, first and after step 1", world, tied,
               before_training=_inner_module_call, between_steps=_at((1,), _inner_module_call)),
        hf_run("module.state_dict() after training", world, tied,
               between_steps=_at((-1,), _inner_state_dict)),
        hf_run("module.save_pretrained() then from_pretrained()", world, tied,
               between_steps=_at((-1,), _save_pretrained_roundtrip)),
    ]  # fmt: skip
    return run_subtests((run.name, functools.partial(compare_training, run)) for run in runs)


def test_hf_models_train_like_the_single_process_reference() -> None:
    assert_subtests_passed(run_distributed(_training_cases, WORLD))


def test_hf_call_paths_match_the_reference_and_training_continues() -> None:
    assert_subtests_passed(run_distributed(_call_path_cases, WORLD))
