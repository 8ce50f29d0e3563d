"""Train a small character-level GPT with fsdp_lite.

    torchrun --standalone --nproc_per_node=2 scripts/train.py --config configs/tiny.yaml \
        [--set train.steps=100 --set fsdp.mixed_precision=bf16 ...]

NCCL on cuda:LOCAL_RANK if CUDA is available, else gloo on CPU; one rank without torchrun.
Data: a deterministic synthetic corpus (no download) unless ``data.path`` names a text file.
Rank 0 prints the loss every ``train.log_every`` steps, shows a progress bar on a terminal
and writes TensorBoard scalars under ``runs/<name>/<timestamp>/``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import random
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

import fsdp_lite
from fsdp_lite.testing.models import GPT, Block, GPTConfig


@dataclass
class ModelConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    dropout: float = 0.0


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 16  # sequences per rank per micro-step
    lr: float = 1e-3
    min_lr: float = 1e-4  # the cosine schedule ends here
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)
    grad_accum: int = 1  # micro-steps per optimizer step
    seed: int = 1337
    log_every: int = 25


@dataclass
class FSDPConfig:
    mixed_precision: str = "fp32"  # fp32 | bf16 | fp16
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False  # recompute every block's activations in backward


@dataclass
class DataConfig:
    path: str | None = None  # a UTF-8 text file; None: the synthetic corpus


@dataclass
class Config:
    name: str | None = None  # TensorBoard run name; default: the config file's stem
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    data: DataConfig = field(default_factory=DataConfig)


class ConfigError(ValueError):
    """A config key is unknown or its value is invalid; the message names the key."""


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


def _build(cls: type, raw: object, prefix: str) -> object:
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


def _validate(cfg: Config) -> None:
    m, t = cfg.model, cfg.train
    checks = [  # (key, ok, requirement)
        ("model.n_layer", m.n_layer >= 1, ">= 1"),
        ("model.n_head", m.n_head >= 1, ">= 1"),
        ("model.n_embd", m.n_embd >= 1 and m.n_embd % m.n_head == 0, "a multiple of n_head"),
        ("model.block_size", m.block_size >= 1, ">= 1"),
        ("model.dropout", 0.0 <= m.dropout < 1.0, "in [0, 1)"),
        ("train.steps", t.steps >= 1, ">= 1"),
        ("train.batch_size", t.batch_size >= 1, ">= 1"),
        ("train.lr", t.lr > 0, "> 0"),
        ("train.min_lr", 0 <= t.min_lr <= t.lr, "in [0, train.lr]"),
        ("train.warmup_steps", t.warmup_steps >= 0, ">= 0"),
        ("train.weight_decay", t.weight_decay >= 0, ">= 0"),
        ("train.grad_clip", t.grad_clip >= 0, ">= 0 (0 disables clipping)"),
        ("train.grad_accum", t.grad_accum >= 1, ">= 1"),
        ("train.log_every", t.log_every >= 1, ">= 1"),
        ("fsdp.mixed_precision", cfg.fsdp.mixed_precision in _DTYPES, "fp32, bf16 or fp16"),
    ]
    for key, ok, requirement in checks:
        if not ok:
            value = functools.reduce(getattr, key.split("."), cfg)
            raise ConfigError(f"{key} must be {requirement}, got {value!r}")
    if cfg.data.path is not None and not Path(cfg.data.path).is_file():
        raise ConfigError(f"data.path must be an existing text file, got {cfg.data.path!r}")


def load_config(path: str, overrides: list[str]) -> Config:
    """Read ``path``, apply ``--set a.b=value`` overrides (values parsed as YAML), validate."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path} must be a mapping of sections, got {raw!r}")
    for item in overrides:
        key, sep, text = item.partition("=")
        *sections, leaf = key.strip().split(".")
        if not sep or not leaf or len(sections) > 1 or not all(sections):
            raise ConfigError(f"--set expects section.key=value (or name=value), got {item!r}")
        target = raw.setdefault(sections[0], {}) if sections else raw
        if not isinstance(target, dict):
            raise ConfigError(f"--set {item!r}: '{sections[0]}' is not a section")
        target[leaf] = yaml.safe_load(text)
    cfg = _build(Config, raw, "")
    _validate(cfg)
    cfg.name = cfg.name or Path(path).stem
    return cfg


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

    def batch(self, batch_size: int, block_size: int, gen: torch.Generator):
        """``(x, y)``, each (B, T): random windows and the same windows shifted by one."""
        starts = torch.randint(len(self.data) - block_size, (batch_size,), generator=gen)
        chunk = self.data[starts[:, None] + torch.arange(block_size + 1)]  # (B, T+1)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def load_data(cfg: Config) -> CharData:
    text = synthetic_corpus() if cfg.data.path is None else Path(cfg.data.path).read_text()
    if len(text) <= cfg.model.block_size + 1:
        raise ConfigError(f"data.path holds {len(text)} characters, fewer than block_size + 2")
    return CharData(text)


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device


def init_distributed() -> Dist:
    """NCCL + cuda:LOCAL_RANK if CUDA is available, else gloo + CPU; one rank without torchrun."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group(backend, device_id=device if cuda else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world_size = dist.get_world_size()
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    return Dist(dist.get_rank(), world_size, device)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr``."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


class LossScaler:
    """Dynamic fp16 loss scaling over sharded grads (a no-op unless ``enabled``).

    Overflow is read from the total grad norm, which ``clip_grad_norm_`` all-reduces, so
    every rank skips the same steps. The scale halves on overflow and doubles after
    ``growth_interval`` clean steps.
    """

    def __init__(self, enabled: bool, scale: float = 2.0**12, growth_interval: int = 200) -> None:
        self.enabled = enabled
        self.scale = scale if enabled else 1.0
        self.growth_interval = growth_interval
        self._clean_steps = 0  # finite steps since the last overflow

    def unscale_(self, params: typing.Iterable[torch.nn.Parameter]) -> None:
        for p in params:
            if self.enabled and p.grad is not None:
                p.grad.mul_(1.0 / self.scale)

    def update(self, overflow: bool) -> None:
        self._clean_steps = 0 if overflow else self._clean_steps + 1
        if self.enabled and overflow:
            self.scale = max(self.scale / 2.0, 1.0)
        elif self.enabled and self._clean_steps % self.growth_interval == 0:
            self.scale *= 2.0


def build_model(cfg: Config, vocab_size: int, d: Dist) -> tuple[fsdp_lite.FSDPModule, int]:
    """The GPT, one unit per Block plus the root; returns it and its parameter count."""
    m = cfg.model
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    gpt = GPT(GPTConfig(vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd, m.dropout))
    n_params = sum(p.numel() for p in gpt.parameters())
    unit_type: type = Block
    if cfg.fsdp.activation_checkpointing:  # unit(checkpoint(block)): one unit per block still
        fsdp_lite.apply_activation_checkpointing(gpt, fsdp_lite.wrap.by_type(Block))
        unit_type = fsdp_lite.checkpoint.CheckpointWrapper
    dtype = _DTYPES[cfg.fsdp.mixed_precision]
    mp = None if dtype == torch.float32 else fsdp_lite.MixedPrecision(dtype, torch.float32)
    model = fsdp_lite.FSDPModule(
        gpt,
        auto_wrap_policy=fsdp_lite.wrap.by_type(unit_type),
        reshard_after_forward=cfg.fsdp.reshard_after_forward,
        mixed_precision=mp,
        sync_module_states=True,
        device=d.device,
    )
    torch.manual_seed(cfg.train.seed + d.rank)  # dropout differs per rank
    return model, n_params


@dataclass
class StepResult:
    loss: float  # mean over micro-batches and ranks
    grad_norm: float  # before clipping
    skipped: bool  # non-finite grads (fp16 overflow): no optimizer step
    seconds: float
    comm: dict  # fsdp_lite.comm_stats() of this step


def train_step(model, opt, scaler: LossScaler, data: CharData, gen, cfg: Config, d: Dist):
    t, start = cfg.train, time.perf_counter()
    fsdp_lite.reset_comm_stats()
    loss_sum = torch.zeros((), device=d.device)
    for micro in range(t.grad_accum):
        x, y = (v.to(d.device) for v in data.batch(t.batch_size, cfg.model.block_size, gen))
        last = micro == t.grad_accum - 1
        with contextlib.nullcontext() if last else model.no_sync():
            _, loss = model(x, y)
            (loss * (scaler.scale / t.grad_accum)).backward()
        loss_sum += loss.detach().float()
    scaler.unscale_(model.parameters())
    norm = model.clip_grad_norm_(t.grad_clip if t.grad_clip > 0 else math.inf)
    finite = bool(torch.isfinite(norm))
    if finite:
        opt.step()
    scaler.update(overflow=not finite)
    opt.zero_grad(set_to_none=True)
    comm = fsdp_lite.comm_stats()  # read before our own all-reduce of the loss below
    dist.all_reduce(loss_sum)  # for logging only; not counted in comm_stats
    loss = loss_sum.item() / (t.grad_accum * d.world_size)
    return StepResult(loss, norm.item(), not finite, time.perf_counter() - start, comm)


def comm_bytes(comm: dict) -> int:
    return sum(op["bytes"] for op in comm.values())


def log(msg: str) -> None:
    tqdm.write(msg)
    sys.stdout.flush()


def log_step(step: int, r: StepResult, lr: float, tokens: int, cfg, writer, scaler) -> None:
    """TensorBoard scalars every step; a stdout line every ``log_every`` steps (rank 0)."""
    tps = tokens / r.seconds
    scalars = {"loss": r.loss, "lr": lr, "grad_norm": r.grad_norm, "tokens_per_s": tps}
    scalars["comm_bytes_per_step"] = comm_bytes(r.comm)
    scalars |= {f"comm_bytes/{op}": s["bytes"] for op, s in r.comm.items()}
    if scaler.enabled:
        scalars["loss_scale"] = scaler.scale
    for key, value in scalars.items():
        writer.add_scalar(key, value, step)
    if step == 1 or step % cfg.train.log_every == 0 or step == cfg.train.steps:
        note = "  (non-finite grads: step skipped)" if r.skipped else ""
        log(
            f"step {step:5d}/{cfg.train.steps} | loss {r.loss:.4f} | lr {lr:.2e} | "
            f"grad_norm {r.grad_norm:.3f} | {tps:,.0f} tok/s | "
            f"comm {comm_bytes(r.comm) / 1e6:.2f} MB/step{note}"
        )


def summarize(model, n_params: int, results: list[StepResult], tokens: int, data, wall: float):
    """Print the end-of-run summary (rank 0)."""
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    units = sum(isinstance(m, fsdp_lite.FSDPModule) for m in model.modules())
    timed = results[1:] or results  # step 1 includes lazy init
    tps = tokens * len(timed) / sum(r.seconds for r in timed)
    last = results[-1].comm
    per_op = ", ".join(
        f"{op} {s['bytes'] / 1e6:.2f} MB in {s['calls']} calls {sorted(s['dtypes'])}"
        for op, s in sorted(last.items())
    )
    log("=" * 72)
    log(f"parameters        {n_params:,} in {units} FSDP units")
    log(f"shard bytes/rank  {shard_bytes:,} ({shard_bytes / 1e6:.2f} MB of fp32 shards)")
    log(f"comm bytes/step   {comm_bytes(last) / 1e6:.2f} MB per rank: {per_op or 'none'}")
    log(f"throughput        {tps:,.0f} tokens/s over all ranks (steps 2+)")
    first, final, ln_v = results[0].loss, results[-1].loss, math.log(data.vocab_size)
    log(f"loss              first {first:.4f} -> last {final:.4f} (ln vocab = {ln_v:.4f})")
    log(f"wall time         {wall:.1f} s for {len(results)} steps")


def train(cfg: Config, data: CharData, d: Dist) -> None:
    model, n_params = build_model(cfg, data.vocab_size, d)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    scaler = LossScaler(enabled=cfg.fsdp.mixed_precision == "fp16")
    gen = torch.Generator().manual_seed(t.seed * 1000 + d.rank)  # different batches per rank
    tokens = t.batch_size * cfg.model.block_size * t.grad_accum * d.world_size
    writer = None
    if d.rank == 0:
        run_dir = Path("runs") / cfg.name / time.strftime("%Y%m%d-%H%M%S")
        writer = SummaryWriter(str(run_dir))
        writer.add_text("config", f"```\n{yaml.safe_dump(dataclasses.asdict(cfg))}```")
        log(
            f"{cfg.name}: {d.world_size} rank(s) on {d.device}, vocab {data.vocab_size}, "
            f"{tokens:,} tokens/step, {cfg.fsdp.mixed_precision}, TensorBoard: {run_dir}"
        )
    bar = tqdm(total=t.steps, disable=None if d.rank == 0 else True, dynamic_ncols=True)
    results: list[StepResult] = []
    start = time.perf_counter()
    for step in range(1, t.steps + 1):
        lr = lr_at(step - 1, t)
        for group in opt.param_groups:
            group["lr"] = lr
        r = train_step(model, opt, scaler, data, gen, cfg, d)
        results.append(r)
        bar.update(1)
        bar.set_postfix(loss=f"{r.loss:.4f}", tok_s=f"{tokens / r.seconds:,.0f}")
        if writer is not None:
            log_step(step, r, lr, tokens, cfg, writer, scaler)
    bar.close()
    if writer is not None:
        writer.close()
        summarize(model, n_params, results, tokens, data, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument(
        "--set", dest="overrides", action="extend", nargs="+", default=[], metavar="K=V"
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        data = load_data(cfg)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    d = init_distributed()
    try:
        train(cfg, data, d)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
