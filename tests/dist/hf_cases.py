"""Tiny Hugging Face models (built from local configs), batches, losses and wrap functions
for tests/dist/test_hf_models.py. Every model is wrapped one unit per decoder layer
(``wrap.transformer_layers``: HF's ``_no_split_modules``), the rest in the root."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutput

import fsdp_lite
from fsdp_lite.testing import GPT, GPTConfig
from fsdp_lite.testing.models import Block
from fsdp_lite.testing.reference import BF16, FP32, Run

VOCAB = 97
SEQ = 16
B_PER_RANK = 2
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2)  # GQA: 2 query heads per KV head
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=None)  # generate: always 8 tokens

PRECISIONS = {
    "fp32": (None, FP32),
    "bf16": (fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16), BF16),
}


# -- models -------------------------------------------------------------------------


def llama(tie: bool = False, checkpointing: bool = False, layers: int = 2) -> LlamaForCausalLM:
    """GQA attention, RoPE (a non-persistent ``inv_freq`` buffer), RMSNorm. ``checkpointing``:
    HF activation (formerly gradient) checkpointing per decoder layer, non-reentrant."""
    cfg = LlamaConfig(
        **{**SMALL, "num_hidden_layers": layers}, **HEADS, **TOKENS, max_position_embeddings=64,
        tie_word_embeddings=tie, attention_dropout=0.0, attn_implementation="eager",
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    if checkpointing:
        kwargs = {"use_reentrant": False}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    return model


def gpt2() -> GPT2LMHeadModel:
    """Conv1D projections (weights stored transposed), learned positions, tied head."""
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", **TOKENS,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def qwen2() -> Qwen2ForCausalLM:
    """Llama's shape plus q/k/v biases; untied head."""
    cfg = Qwen2Config(
        **SMALL, **HEADS, **TOKENS, max_position_embeddings=64, tie_word_embeddings=False,
        attention_dropout=0.0, attn_implementation="eager",
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg)


def lora_llama(**llama_kwargs) -> nn.Module:
    """PEFT LoRA (r=4) on q_proj and v_proj of an untied Llama: the base is frozen."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(llama(**llama_kwargs), config)


HF_MODELS = {
    "llama tied": functools.partial(llama, tie=True),
    "llama untied": llama,
    "gpt2": gpt2,
    "qwen2": qwen2,
}


# -- batches, losses, wrapping ------------------------------------------------------


def token_batch(world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: ``(input_ids, labels)``, labels = inputs (HF shifts them itself)."""
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randint(3, VOCAB, (B_PER_RANK * world, SEQ), generator=g)  # no special tokens
    return x, x.clone()


def local_tokens(step: int) -> torch.Tensor:
    """This rank's slice of a batch no training step uses (for inference checks)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return token_batch(world, 1000 + step)[0].chunk(world)[rank]


def hf_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return model(input_ids=x, labels=y, use_cache=False).loss


def wrap_layers(model: nn.Module, mixed_precision=None) -> fsdp_lite.FSDPModule:
    policy = fsdp_lite.wrap.by_type(*fsdp_lite.wrap.transformer_layers(model))
    return fsdp_lite.FSDPModule(model, auto_wrap_policy=policy, mixed_precision=mixed_precision)


def hf_run(name: str, world: int, make_model, precision: str = "fp32", **kw) -> Run:
    mp, tol = PRECISIONS[precision]
    return Run(
        name=f"{name} {precision}",
        make_model=make_model,
        batch=functools.partial(token_batch, world),
        loss=hf_loss,
        wrap=kw.pop("wrap", functools.partial(wrap_layers, mixed_precision=mp)),
        tol=tol,
        **kw,
    )


# -- custom outputs: a root whose forward returns a structure, units inside ---------------


@dataclass
class LossLogits:
    """A plain dataclass (not registered with torch's pytree)."""

    loss: torch.Tensor
    logits: torch.Tensor


class LossLogitsTuple(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


OUTPUT_TYPES = {
    "dataclass": LossLogits,
    "NamedTuple": LossLogitsTuple,
    "HF ModelOutput": CausalLMOutput,
}


class StructuredOutput(nn.Module):
    """The test GPT (its Blocks become units) returning ``output_type(loss=, logits=)``."""

    def __init__(self, output_type: type) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig())
        self.output_type = output_type

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        logits, loss = self.gpt(idx, targets)
        return self.output_type(loss=loss, logits=logits)


def gpt_token_batch(world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, GPTConfig().vocab_size, (B_PER_RANK * world, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def output_run(kind: str, world: int) -> Run:
    return Run(
        name=f"forward returns a {kind}",
        make_model=functools.partial(StructuredOutput, OUTPUT_TYPES[kind]),
        batch=functools.partial(gpt_token_batch, world),
        loss=lambda model, batch: model(*batch).loss,
        wrap=lambda m: fsdp_lite.FSDPModule(m, auto_wrap_policy=fsdp_lite.wrap.by_type(Block)),
    )
