"""The training script's run: its configuration (dataclasses, YAML, ``--set`` overrides,
validation) and its data (a deterministic corpus and resumable per-rank batches).

A run is a YAML file of sections (``model``, ``train``, ``fsdp``, ``parallel``, ``optim``,
``data``, ``checkpoint``, ``log``, ``debug``) plus ``--set section.key=value`` overrides,
values parsed as YAML.
Everything is checked before any process group exists: unknown keys, wrong types, bad
values, and world sizes the run cannot use each raise :class:`ConfigError` naming the key.

No download: unless ``data.path`` names a text file, the corpus is generated from a
seeded grammar. Characters are the tokens (with ``model.hf``, the HF tokenizer's if it
has one). Each epoch cuts the corpus into windows of ``block_size + 1`` tokens at a random
offset and visits them in a random order;
the ranks take disjoint slices of every global batch, so each sees different samples.
The whole stream is a function of (seed, position), so a checkpoint that records the
position resumes it exactly.

``python scripts/train_config.py`` prints the table of keys that docs/training-script.md carries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

DTYPES = ("fp32", "bf16", "fp16")
WRAPS = ("block", "size", "none")
OFFLOADS = ("none", "cpu", "ssd")
ACCUMULATE = ("auto", "keep", "no_sync", "sync")
OPTIMIZERS = ("adamw", "muon")


class ConfigError(ValueError):
    """A config key is unknown or its value is invalid; the message names the key."""


def opt(default: Any, doc: str) -> Any:
    """A config field: its default and the one line the docs table shows for it."""
    return field(default=default, metadata={"doc": doc})


@dataclass
class ModelConfig:
    n_layer: int = opt(4, "transformer blocks")
    n_head: int = opt(4, "attention heads; must divide `n_embd`")
    n_embd: int = opt(64, "embedding width")
    block_size: int = opt(64, "sequence length in tokens (characters)")
    dropout: float = opt(0.0, "dropout probability, in [0, 1)")
    hf: str | None = opt(
        None,
        "a Hugging Face causal LM instead of the GPT: a directory with `config.json` (optional "
        "`*.safetensors` weights, tokenizer files) or an HF config `.json`; the GPT keys above "
        "but `block_size` are then unused (null: the built-in GPT)",
    )


@dataclass
class TrainConfig:
    steps: int = opt(300, "optimizer steps in the whole run")
    batch_size: int = opt(16, "sequences per rank per micro-step")
    global_batch_size: int | None = opt(
        None, "sequences per optimizer step over all ranks; sets `grad_accum` (null: unset)"
    )
    grad_accum: int = opt(1, "micro-steps per optimizer step")
    accumulate: str = opt(
        "auto",
        "micro-steps before the last: `keep` (full parameters kept, each unit gathered once "
        "a step), `no_sync` (gathered each micro-step, reduced once), `sync` (reduced each "
        "micro-step); `auto`: `keep` where the planner's estimate fits the device, else "
        "`no_sync`",
    )
    lr: float = opt(1e-3, "peak learning rate (AdamW)")
    min_lr: float = opt(1e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = opt(20, "linear warmup steps")
    weight_decay: float = opt(0.1, "AdamW weight decay")
    grad_clip: float = opt(1.0, "max total grad norm; 0 disables clipping (the norm is logged)")
    seed: int = opt(1337, "initial weights, data order and dropout")
    log_every: int = opt(25, "steps between printed lines (TensorBoard gets every step)")


@dataclass
class FSDPConfig:
    mixed_precision: str = opt(
        "fp32", "fp32, bf16 or fp16 (loss-scaled) compute and gathers; grads reduce in fp32"
    )
    reshard_after_forward: bool | None = opt(
        None,
        "null: free full params after forward in every unit but the root and (with prefetch) "
        "the last block; true/false: all",
    )
    wrap: str = opt("block", "units: `block` (one per transformer block), `size` or `none`")
    wrap_min_params: int = opt(
        100_000, "`wrap: size`: a module (not a ModuleList/Dict) becomes a unit at this many params"
    )
    activation_checkpointing: bool = opt(False, "recompute each block's activations in backward")
    compile: bool = opt(
        False,
        "`torch.compile` each transformer block's forward before wrapping (inductor, "
        "`fsdp_lite.compile_blocks`; not with `wrap: size`); the first steps include compile "
        "time",
    )
    prefetch: int = opt(1, "units gathered ahead of the running one, forward and backward (0: off)")
    offload: str = opt("none", "where shards, grads and optimizer state live: none, cpu or ssd")
    offload_dir: str | None = opt(
        None, "`offload: ssd` directory (null: `$TMPDIR/fsdp_lite_<name>`)"
    )
    shard_size: int | None = opt(
        None, "hybrid sharding: shard within groups of this many ranks, replicate across"
    )
    timeout_s: float = opt(120.0, "process-group timeout: a silent peer fails the job after it")


@dataclass
class ParallelConfig:
    tp: int = opt(
        1,
        "tensor-parallel degree: the GPT's Megatron plan (`fsdp_lite.testing.models."
        "parallelize_gpt`) over groups of this many ranks, fsdp_lite over the rest (a dp x tp "
        "`DeviceMesh`; with `fsdp.shard_size`, replicate x shard x tp); must divide the world "
        "size and `model.n_head`; not with `model.hf`, `fsdp.compile` or `optim.name: muon`",
    )


@dataclass
class OptimConfig:
    name: str = opt(
        "adamw",
        "`adamw` (every parameter), or `muon`: `torch.optim.Muon` on the blocks' 2-D matrices "
        "and AdamW (`train.lr`) on the rest, over whole-parameter shards "
        "(`FSDPModule(optimizer_params='whole')`: each rank owns whole matrices)",
    )
    muon_lr: float = opt(0.02, "`muon`: Muon's peak learning rate (warmup and decay as `train.lr`)")


@dataclass
class DataConfig:
    path: str | None = opt(None, "a UTF-8 text file to train on (null: the synthetic corpus)")


@dataclass
class CheckpointConfig:
    dir: str | None = opt(None, "where checkpoints go (null: `checkpoints/<name>`)")
    every: int = opt(0, "steps between checkpoints, plus one at the end (0: none)")
    keep: int = opt(2, "most recent checkpoints kept (0: all)")
    resume: str = opt(
        "never",
        "`never` (a fresh run: refused where the checkpoint dir holds an earlier run's "
        "checkpoints, which `--overwrite` deletes), `auto` (the latest complete checkpoint, if "
        "any) or a checkpoint path; `--resume [PATH]` sets it; torchrun restarts always resume "
        "`auto`",
    )
    export_hf: bool = opt(
        True,
        "with `model.hf`: save the final model (and tokenizer) for `from_pretrained` to "
        "`<checkpoint dir>/hf_final`",
    )


@dataclass
class LogConfig:
    dir: str = opt("runs", "TensorBoard event files go to `<dir>/<name>`")
    tensorboard: bool = opt(True, "write TensorBoard scalars (rank 0)")
    progress: bool | None = opt(None, "tqdm progress bar (null: when stderr is a terminal)")


@dataclass
class DebugConfig:
    crash_at_step: int = opt(
        0, "SIGKILL one rank in this step of the first attempt, to test restarts (0: off)"
    )
    crash_rank: int | None = opt(None, "the rank `crash_at_step` kills (null: the last rank)")


@dataclass
class Config:
    name: str | None = opt(None, "run name (null: the config file's stem)")
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- reading -----------------------------------------------------------------------


def _coerce(key: str, value: object, tp: object) -> object:
    """Check ``value`` against the annotation ``tp`` (int, float, bool, str or X | None)."""
    allowed = typing.get_args(tp) or (tp,)
    if value is None and type(None) in allowed:
        return None
    if float in allowed:
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            with contextlib.suppress(ValueError):
                return float(value)
    for t in allowed:
        if t is not type(None) and isinstance(value, t):
            if not (t is int and isinstance(value, bool)):
                return value
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"{key} must be {names}, got {value!r}")


def _build(cls: type, raw: object, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'the config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in hints:
            known = ", ".join(prefix + k for k in hints)
            raise ConfigError(f"unknown key '{prefix}{key}' (known: {known})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(prefix + key, value, tp)
    return cls(**kwargs)


def _apply_overrides(raw: dict, overrides: list[str]) -> None:
    for item in overrides:
        key, sep, text = item.partition("=")
        *sections, leaf = key.strip().split(".")
        if not sep or not leaf or len(sections) > 1 or not all(sections):
            raise ConfigError(f"--set expects section.key=value (or name=value), got {item!r}")
        target = raw.setdefault(sections[0], {}) if sections else raw
        if not isinstance(target, dict):
            raise ConfigError(f"--set {item!r}: '{sections[0]}' is not a section")
        try:
            target[leaf] = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML: {e}") from e


# -- checking ----------------------------------------------------------------------


def _value_checks(cfg: Config) -> list[tuple[str, bool, str]]:
    """(key, ok, requirement) for every value that must hold whatever the world size."""
    m, t, f, c, d = cfg.model, cfg.train, cfg.fsdp, cfg.checkpoint, cfg.debug
    p = cfg.parallel
    return [
        ("name", bool(cfg.name) and "/" not in cfg.name, "a non-empty name without '/'"),
        ("model.n_layer", m.n_layer >= 1, ">= 1"),
        ("optim.name", cfg.optim.name in OPTIMIZERS, " or ".join(OPTIMIZERS)),
        ("optim.muon_lr", cfg.optim.muon_lr > 0, "> 0"),
        ("model.n_head", m.n_head >= 1, ">= 1"),
        ("model.n_embd", m.n_embd >= 1 and m.n_embd % m.n_head == 0, "a multiple of n_head"),
        ("model.block_size", m.block_size >= 1, ">= 1"),
        ("model.dropout", 0.0 <= m.dropout < 1.0, "in [0, 1)"),
        ("train.steps", t.steps >= 1, ">= 1"),
        ("train.batch_size", t.batch_size >= 1, ">= 1"),
        ("train.global_batch_size", (t.global_batch_size or 1) >= 1, ">= 1 or null"),
        ("train.grad_accum", t.grad_accum >= 1, ">= 1"),
        ("train.accumulate", t.accumulate in ACCUMULATE, " or ".join(ACCUMULATE)),
        ("train.lr", t.lr > 0, "> 0"),
        ("train.min_lr", 0 <= t.min_lr <= t.lr, "in [0, train.lr]"),
        ("train.warmup_steps", t.warmup_steps >= 0, ">= 0"),
        ("train.weight_decay", t.weight_decay >= 0, ">= 0"),
        ("train.grad_clip", t.grad_clip >= 0, ">= 0 (0 disables clipping)"),
        ("train.log_every", t.log_every >= 1, ">= 1"),
        ("fsdp.mixed_precision", f.mixed_precision in DTYPES, " or ".join(DTYPES)),
        ("fsdp.wrap", f.wrap in WRAPS, " or ".join(WRAPS)),
        ("fsdp.wrap_min_params", f.wrap_min_params >= 1, ">= 1"),
        (
            "fsdp.compile",
            not (f.compile and f.wrap == "size"),
            "false with fsdp.wrap=size (a unit could sit inside a compiled block)",
        ),
        ("fsdp.prefetch", f.prefetch >= 0, ">= 0 (0 disables prefetching)"),
        ("fsdp.offload", f.offload in OFFLOADS, " or ".join(OFFLOADS)),
        ("fsdp.shard_size", (f.shard_size or 1) >= 1, ">= 1 or null"),
        ("fsdp.timeout_s", f.timeout_s > 0, "> 0"),
        ("parallel.tp", p.tp >= 1 and m.n_head % p.tp == 0, ">= 1 and divide model.n_head"),
        (
            "parallel.tp",
            p.tp == 1 or (m.hf is None and not f.compile and cfg.optim.name != "muon"),
            "1 with model.hf, fsdp.compile or optim.name=muon (the GPT's TP plan, eager, "
            "flat shards)",
        ),
        ("checkpoint.every", c.every >= 0, ">= 0 (0: no checkpoints)"),
        ("checkpoint.keep", c.keep >= 0, ">= 0 (0: keep all)"),
        ("checkpoint.resume", bool(c.resume), "never, auto or a checkpoint path"),
        ("debug.crash_at_step", 0 <= d.crash_at_step <= t.steps, "in [0, train.steps]"),
        ("debug.crash_rank", (d.crash_rank or 0) >= 0, ">= 0 or null"),
    ]


def _fail(cfg: Config, key: str, requirement: str) -> typing.NoReturn:
    value = functools.reduce(getattr, key.split("."), cfg)
    raise ConfigError(f"{key} must be {requirement}, got {value!r}")


def validate(cfg: Config) -> None:
    """Values that are wrong whatever the world size."""
    for key, ok, requirement in _value_checks(cfg):
        if not ok:
            _fail(cfg, key, requirement)
    if cfg.data.path is not None and not Path(cfg.data.path).is_file():
        _fail(cfg, "data.path", "an existing text file")
    if cfg.model.hf is not None and not Path(cfg.model.hf).exists():
        _fail(cfg, "model.hf", "an HF model directory or config .json file (or null)")
    if cfg.checkpoint.resume not in ("never", "auto") and not Path(cfg.checkpoint.resume).is_dir():
        _fail(cfg, "checkpoint.resume", "never, auto or an existing checkpoint directory")
    if cfg.debug.crash_at_step and not cfg.checkpoint.every:
        raise ConfigError("debug.crash_at_step needs checkpoint.every > 0 to restart from")


def check_world(cfg: Config, world_size: int) -> None:
    """Settings the given world size cannot run; resolves ``train.grad_accum`` from
    ``train.global_batch_size``. (The corpus is checked in ``load_data``.)"""
    t, f, tp = cfg.train, cfg.fsdp, cfg.parallel.tp
    where = f"with {world_size} rank(s)"
    if world_size % tp:
        raise ConfigError(
            f"parallel.tp={tp} must divide the world size {world_size}: the ranks form a "
            "dp x tp mesh"
        )
    dp = world_size // tp  # the ranks that see different data
    if f.shard_size is not None and dp % f.shard_size:
        over = f" over parallel.tp={tp} (= {dp})" if tp > 1 else ""
        raise ConfigError(
            f"fsdp.shard_size={f.shard_size} must divide the world size {world_size}{over}: "
            "hybrid sharding needs equal shard groups (use e.g. the number of GPUs per node)"
        )
    if t.global_batch_size is not None:
        per_micro = t.batch_size * dp
        accum, rest = divmod(t.global_batch_size, per_micro)
        if rest or not accum:
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} must be a multiple of "
                f"train.batch_size x data-parallel size = {t.batch_size} x {dp} = {per_micro} "
                f"{where}"
            )
        if t.grad_accum not in (1, accum):
            raise ConfigError(
                f"train.grad_accum={t.grad_accum} contradicts train.global_batch_size="
                f"{t.global_batch_size} {where} (which needs {accum}); set only one of them"
            )
        t.grad_accum = accum
    crash_rank = cfg.debug.crash_rank
    if cfg.debug.crash_at_step and crash_rank is not None and crash_rank >= world_size:
        raise ConfigError(f"debug.crash_rank={crash_rank} does not exist {where}")


def load_config(path: str, overrides: list[str], world_size: int | None = None) -> Config:
    """Read ``path``, apply ``--set a.b=value`` overrides, validate; with ``world_size``
    also check that this many ranks can run it."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path} must be a mapping of sections, got {raw!r}")
    _apply_overrides(raw, overrides)
    cfg = _build(Config, raw, "")
    cfg.name = cfg.name if cfg.name is not None else Path(path).stem
    validate(cfg)
    if world_size is not None:
        check_world(cfg, world_size)
    return cfg


# -- documentation -----------------------------------------------------------------


def config_keys() -> list[tuple[str, Any, str]]:
    """(dotted key, default, meaning) of every config key, in declaration order."""
    rows = []

    def visit(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            if "doc" in f.metadata:
                rows.append((prefix + f.name, f.default, f.metadata["doc"]))
            else:
                visit(f.default_factory, f"{prefix}{f.name}.")

    visit(Config, "")
    return rows


def markdown_table() -> str:
    def show(value: Any) -> str:
        return "null" if value is None else yaml.safe_dump(value).removesuffix("\n...\n").strip()

    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{k}` | `{show(v)}` | {doc} |" for k, v, doc in config_keys()]
    return "\n".join(lines)


# -- the data ----------------------------------------------------------------------


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


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
