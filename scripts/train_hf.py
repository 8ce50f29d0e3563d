"""The training script's Hugging Face models (``model.hf``): source, config, tokenizer,
model and the final export. transformers is imported here only, inside the functions, so
runs of the built-in GPT never import it.

``model.hf`` names a directory holding ``config.json`` (plus, optionally, ``*.safetensors``
weights and tokenizer files) or a single HF config ``.json`` file. With weights the model
is ``from_pretrained``; without, ``from_config`` (random init, seeded alike on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from train_config import Config, ConfigError

import fsdp_lite


@dataclass
class HFSource:
    """Where the HF model comes from: ``config`` is a file or a directory for
    ``AutoConfig.from_pretrained``; ``weights``/``tokenizer_dir``: None when absent."""

    config: Path
    weights: Path | None
    tokenizer_dir: Path | None


def hf_source(path: str) -> HFSource:
    p = Path(path)
    if p.is_file():
        return HFSource(p, None, None)
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"model.hf={path!r} must be an HF config .json file or a directory holding "
            "config.json (make one with transformers' XConfig(...).save_pretrained(dir))"
        )
    weights = p if any(p.glob("*.safetensors")) else None
    return HFSource(p, weights, p)


def load_hf_config(src: HFSource) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(src.config))
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf: {src.config} is not a readable HF config: {e}") from e


def load_tokenizer(src: HFSource) -> Any | None:
    """The directory's tokenizer, or None (the script then uses characters as tokens)."""
    if src.tokenizer_dir is None:
        return None
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((src.tokenizer_dir / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(src.tokenizer_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf: cannot load the tokenizer in {src.tokenizer_dir}: {e}") from e


def check_vocab(cfg: Config, hf_config: Any, vocab_size: int, max_id: int, tokenizer: Any) -> None:
    """The model must embed every token id of the corpus and see ``block_size`` positions."""
    model_vocab = getattr(hf_config, "vocab_size", None)
    if model_vocab is not None and tokenizer is None and model_vocab < vocab_size:
        raise ConfigError(
            f"model.hf: the model's vocab_size {model_vocab} is smaller than the character "
            f"vocabulary of the corpus ({vocab_size}); set vocab_size >= {vocab_size} in "
            f"{cfg.model.hf}'s config.json or add a tokenizer to that directory"
        )
    if model_vocab is not None and max_id >= model_vocab:
        raise ConfigError(
            f"model.hf: the tokenizer produces ids up to {max_id} but the model's vocab_size "
            f"is {model_vocab}; use a model whose embedding covers the tokenizer"
        )
    positions = getattr(hf_config, "max_position_embeddings", None)
    if positions is not None and cfg.model.block_size > positions:
        raise ConfigError(
            f"model.block_size={cfg.model.block_size} exceeds the model's "
            f"max_position_embeddings {positions}; lower model.block_size"
        )


def build_hf_model(cfg: Config) -> nn.Module:
    """The unwrapped causal LM in fp32 (the caller seeds torch alike on every rank)."""
    from transformers import AutoModelForCausalLM

    src = hf_source(cfg.model.hf)
    if src.weights is not None:
        return AutoModelForCausalLM.from_pretrained(str(src.weights), dtype=torch.float32)
    return AutoModelForCausalLM.from_config(load_hf_config(src), dtype=torch.float32)


def layer_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The HF model's transformer layer classes (``_no_split_modules``): one unit each."""
    return fsdp_lite.wrap.transformer_layers(model)


def export(out: Path, model: fsdp_lite.FSDPModule, tokenizer: Any | None, rank: int) -> Path:
    """Write the final model as an HF checkpoint in ``out`` (collective: every rank calls
    it), plus the tokenizer if there is one, so ``AutoModelForCausalLM.from_pretrained(out)``
    loads it."""
    fsdp_lite.save_pretrained(model, out)
    if tokenizer is not None and rank == 0:
        tokenizer.save_pretrained(str(out))
    return out
