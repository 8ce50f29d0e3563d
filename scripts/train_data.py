"""The training script's data: a deterministic corpus and resumable per-rank batches.

No download: unless ``data.path`` names a text file, the corpus is generated from a
seeded grammar. Characters are the tokens (with ``model.hf``, the HF tokenizer's if it
has one). Each epoch cuts the corpus into windows of ``block_size + 1`` tokens at a random
offset and visits them in a random order;
the ranks take disjoint slices of every global batch, so each sees different samples.
The whole stream is a function of (seed, position), so a checkpoint that records the
position resumes it exactly.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from train_config import Config, ConfigError

_ADJ = ["red", "small", "old", "quick", "lazy", "happy", "green", "tall"]
_NOUN = ["fox", "dog", "cat", "bird", "man", "girl", "tree", "horse"]
_VERB = ["sees", "likes", "chases", "finds", "helps", "follows"]
_NUM = "zero one two three four five six seven eight nine ten eleven twelve".split()


def synthetic_corpus(n_chars: int = 200_000, seed: int = 0) -> str:
    """Seeded lines of a tiny grammar, addition facts and counting runs: most characters
    follow from the ones before, so a tiny GPT's loss falls far below ln(vocab) quickly."""
    rng = random.Random(seed)
    lines: list[str] = []
    size = 0
    while size < n_chars:
        kind = rng.random()
        if kind < 0.5:
            a, n, v, b, o = (rng.choice(x) for x in (_ADJ, _NOUN, _VERB, _ADJ, _NOUN))
            line = f"the {a} {n} {v} the {b} {o}."
        elif kind < 0.8:
            x, y = rng.randrange(10), rng.randrange(10)
            line = f"{x} plus {y} is {x + y}."
        else:
            start = rng.randrange(len(_NUM) - 4)
            line = "count " + " ".join(_NUM[start : start + rng.randint(3, 5)]) + "."
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines) + "\n"


class CharData:
    """A character-level corpus as one long tensor of token ids."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)  # (N,)
        self.vocab_size = len(self.chars)


class TokenData:
    """A corpus encoded by a Hugging Face tokenizer (``model.hf`` with tokenizer files)."""

    def __init__(self, text: str, tokenizer: Any) -> None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.data = torch.tensor(ids, dtype=torch.long)  # (N,)
        self.vocab_size = len(tokenizer)


Corpus = CharData | TokenData


class Batches:
    """This rank's batches: ``next()`` returns ``(x, y)``, each (B, T), y shifted by one.

    ``position`` counts the sequences all ranks have consumed since the start of the
    run; it is the only state (``state_dict``), since epoch order and offsets are drawn
    from ``seed`` and the epoch number.
    """

    def __init__(
        self, data: Corpus, block_size: int, batch_size: int, rank: int, world: int, seed: int
    ) -> None:
        self.data, self.block_size, self.batch_size = data, block_size, batch_size
        self.rank, self.world, self.seed = rank, world, seed
        self.windows = (len(data.data) - 1) // block_size - 1  # whole windows at any offset
        global_batch = batch_size * world
        self.epoch_len = self.windows // global_batch * global_batch  # drop the ragged end
        self.position = 0
        self._epoch: tuple[int, torch.Tensor, int] | None = None  # (epoch, order, offset)

    def _order(self, epoch: int) -> tuple[torch.Tensor, int]:
        if self._epoch is None or self._epoch[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            offset = int(torch.randint(self.block_size, (1,), generator=gen))
            self._epoch = (epoch, torch.randperm(self.windows, generator=gen), offset)
        return self._epoch[1], self._epoch[2]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, i = divmod(self.position, self.epoch_len)
        order, offset = self._order(epoch)
        mine = order[i + self.rank * self.batch_size : i + (self.rank + 1) * self.batch_size]
        starts = offset + mine * self.block_size
        chunk = self.data.data[starts[:, None] + torch.arange(self.block_size + 1)]  # (B, T+1)
        self.position += self.batch_size * self.world
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "epoch": self.position // self.epoch_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def load_data(cfg: Config, world_size: int, tokenizer: Any | None = None) -> Corpus:
    """The corpus, characters as tokens or encoded by ``tokenizer`` (an HF tokenizer); a
    ``ConfigError`` if it holds less than one global batch of sequences."""
    if cfg.data.path is None:
        text = synthetic_corpus()
    else:
        try:
            text = Path(cfg.data.path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"data.path {cfg.data.path!r} is not a readable UTF-8 file: {e}"
            ) from e
    data = CharData(text) if tokenizer is None else TokenData(text, tokenizer)
    t, block = cfg.train, cfg.model.block_size
    windows = (len(data.data) - 1) // block - 1
    if windows < t.batch_size * world_size:
        source = "the synthetic corpus" if cfg.data.path is None else f"data.path {cfg.data.path}"
        raise ConfigError(
            f"{source} holds {len(data.data):,} tokens, {max(windows, 0)} sequences of "
            f"model.block_size={block}: fewer than one global batch of train.batch_size x "
            f"world size = {t.batch_size} x {world_size}; use a longer text, fewer ranks or "
            "a smaller batch"
        )
    return data
