"""One benchmark run on one rank: build the GPT, wrap it with one system, time it,
count its collectives and measure its memory. ``scripts/bench.py`` spawns the ranks.

Systems: ``fsdp_lite``, ``fsdp2`` (``fully_shard``), ``fsdp1`` (``FullyShardedDataParallel``)
and ``ddp``. Every system gets the same model (same seed, built before wrapping), the same
data, per-block units plus the root, and AdamW.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from bench_measure import count_collectives, peak_from_profile
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

import fsdp_lite
from fsdp_lite.testing.models import GPT, Block, GPTConfig

SYSTEMS = ("fsdp_lite", "fsdp_lite-nocheck", "fsdp2", "fsdp1", "ddp")
# fsdp_lite-nocheck: fsdp_lite with its divergence check off, to price the check.
# fsdp_lite-orig / fsdp_lite-whole (not in SYSTEMS; bench_host uses them): the optimizer
# over use_orig_params pieces / whole_params parameters instead of flat shards.
LAYOUTS = {"fsdp_lite-orig": {"use_orig_params": True}, "fsdp_lite-whole": {"whole_params": True}}
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class BenchConfig:
    """Everything a rank needs to run one (system, precision) case; picklable."""

    layers: int = 4
    dim: int = 256
    heads: int = 4
    seq: int = 256
    batch: int = 4  # sequences per rank per step
    vocab: int = 4096
    checkpoint: bool = False  # activation checkpointing of every block, in every system
    steps: int = 20  # timed steps
    warmup: int = 3
    profile_steps: int = 3  # steps of the profiled (memory) pass; the first is not counted
    threads: int = 1  # torch intra-op threads per rank
    seed: int = 1234
    lr: float = 1e-3
    timeout_s: float = 600.0

    def gpt_config(self) -> GPTConfig:
        return tied_gpt_config(self)


def tied_gpt_config(cfg: Any) -> GPTConfig:
    """The benchmarks' GPT (tied head, no dropout) from a config's layers, dim, heads,
    vocab and seq (``BenchConfig``, ``bench_scale.ScaleConfig``)."""
    return GPTConfig(
        vocab_size=cfg.vocab,
        block_size=cfg.seq,
        n_layer=cfg.layers,
        n_head=cfg.heads,
        n_embd=cfg.dim,
        dropout=0.0,
        tie_weights=True,
    )


# -- systems -----------------------------------------------------------------------------


def build_system(system: str, precision: str, cfg: BenchConfig, device: torch.device) -> nn.Module:
    """The GPT (seeded identically on every rank and system), wrapped by ``system``, its
    blocks activation-checkpointed (non-reentrant) if ``cfg.checkpoint``."""
    model = _wrap(system, precision, cfg, device)
    if cfg.checkpoint and system.startswith("fsdp_lite"):  # ckpt(unit(block))
        fsdp_lite.apply_activation_checkpointing(
            model, lambda m: isinstance(m, fsdp_lite.FSDPModule) and m is not model
        )
    elif cfg.checkpoint and system == "fsdp1":  # inside each FSDP unit, the usual recipe
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    return model


def _checkpoint_blocks(model: GPT) -> None:
    """Before wrapping (FSDP2, DDP): every block behind torch's checkpoint wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


def _wrap(system: str, precision: str, cfg: BenchConfig, device: torch.device) -> nn.Module:
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.gpt_config()).to(device)
    if cfg.checkpoint and system in ("fsdp2", "ddp"):
        _checkpoint_blocks(model)
    bf16 = precision == "bf16"
    world = dist.get_world_size()
    if system.startswith("fsdp_lite"):
        fsdp_lite.core.divergence.set_divergence_check(
            "off" if system.endswith("nocheck") else "cheap"
        )
        mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return fsdp_lite.FSDPModule(
            model,
            auto_wrap_policy=fsdp_lite.wrap.by_type(Block),
            mixed_precision=mp if bf16 else None,
            device=device,
            **LAYOUTS.get(system, {}),
        )
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = mp if bf16 else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)
    if system == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mp1 = MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
        )
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            mixed_precision=mp1 if bf16 else None,
            use_orig_params=False,
            device_id=device,  # also on CPU: FSDP1 refuses to guess a CPU device
        )
    if system == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        # DDP's reducer calls C++ directly; the stock hook does the same averaging
        # all-reduce through dist.all_reduce, where the counter sees it.
        ddp.register_comm_hook(None, allreduce_hook)
        return ddp
    raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")


def make_batches(cfg: BenchConfig, rank: int, n: int, device: torch.device) -> list[tuple]:
    """``n`` (inputs, targets) batches of random tokens, the same for every system."""
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    tokens = torch.randint(cfg.vocab, (n, cfg.batch, cfg.seq + 1), generator=g)
    return [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in tokens]


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: tuple, autocast: bool
) -> torch.Tensor:
    """zero_grad, forward, backward, AdamW step; returns the (detached) loss."""
    x, y = batch
    opt.zero_grad(set_to_none=True)
    ctx = (
        torch.autocast(x.device.type, dtype=torch.bfloat16)
        if autocast
        else contextlib.nullcontext()
    )
    with ctx:
        _, loss = model(x, y)
    loss.backward()
    opt.step()
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return loss.detach()


def _make_optimizer(model: nn.Module, cfg: BenchConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)


# -- passes ------------------------------------------------------------------------------


def timed_pass(
    system: str, precision: str, cfg: BenchConfig, device: torch.device, batches: list
) -> dict[str, Any]:
    """Warm-up, then ``cfg.steps`` timed steps with the collectives counted."""
    model = build_system(system, precision, cfg, device)
    opt = _make_optimizer(model, cfg)
    autocast = system == "ddp" and precision == "bf16"
    losses: list[float] = []
    for i in range(cfg.warmup):
        losses.append(train_step(model, opt, batches[i], autocast).item())
    lib = LibraryAccounting(system)
    times: list[float] = []
    cpu_times: list[float] = []  # CPU time of all this rank's threads: robust to a busy machine
    with count_collectives() as counts:
        for i in range(cfg.warmup, cfg.warmup + cfg.steps):
            lib.before_step()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = train_step(model, opt, batches[i], autocast)
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
            lib.after_step()
            losses.append(loss.item())
    comm = {k: {f: v / cfg.steps for f, v in c.items()} for k, c in counts.items()}
    return {
        "step_times_s": times,
        "step_cpu_s": cpu_times,
        "losses": losses,
        "comm_per_step": comm,
        "library": lib.summary(times, model),
        "num_params_local": sum(p.numel() for p in model.parameters()),
    }


def profiled_pass(
    system: str, precision: str, cfg: BenchConfig, device: torch.device, batches: list
) -> dict[str, float]:
    """Build, wrap and train ``cfg.profile_steps`` steps under the profiler's allocator events.

    The profiler starts before the model exists, so the running sum of allocator events
    is the tensor memory live on this rank; the peak is taken inside the steps after the
    first (the first one allocates the optimizer state).
    """
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    autocast = system == "ddp" and precision == "bf16"
    with profile(activities=acts, profile_memory=True) as prof:
        model = build_system(system, precision, cfg, device)
        opt = _make_optimizer(model, cfg)
        for i in range(cfg.profile_steps):
            with record_function("bench::step"):
                train_step(model, opt, batches[i % len(batches)], autocast)
        del model, opt
    return peak_from_profile(prof, device)


# -- fsdp_lite's own accounting ------------------------------------------------------------


class LibraryAccounting:
    """fsdp_lite's own per-step figures, read through whatever API this version offers.

    ``fsdp_lite.stats()`` / ``reset_stats()`` (bytes, exposed communication, peak full
    parameter bytes) when present, else ``comm_stats()`` / ``reset_comm_stats()``; nothing
    for the other systems. Reset before and read after each timed step, outside the timing.
    """

    def __init__(self, system: str) -> None:
        self.api = ""
        self.read: Callable[[], Any] | None = None
        self.reset: Callable[[], Any] | None = None
        self.steps: list[Any] = []
        pairs = [("stats", "reset_stats"), ("comm_stats", "reset_comm_stats")]
        for read, reset in pairs if system.startswith("fsdp_lite") else []:
            fns = getattr(fsdp_lite, read, None), getattr(fsdp_lite, reset, None)
            if all(callable(fn) for fn in fns):
                self.api, (self.read, self.reset) = read, fns
                break

    def before_step(self) -> None:
        if self.reset is not None:
            self.reset()

    def after_step(self) -> None:
        if self.read is not None:
            self.steps.append(_jsonable(self.read()))

    def summary(self, step_times: list[float], model: nn.Module) -> dict[str, Any]:
        """The last step's figures, exposed communication over all steps, and the root's
        ``memory_stats()`` after the last step, as far as the library reports them."""
        if not self.steps:
            return {}
        last = self.steps[-1]
        out: dict[str, Any] = {"api": f"fsdp_lite.{self.api}()", "last_step": last}
        if callable(getattr(model, "memory_stats", None)):
            out["memory_stats"] = _jsonable(model.memory_stats())
        exposed = [s.get("exposed_s") for s in self.steps if isinstance(s, dict)]
        if exposed and all(isinstance(e, (int, float)) for e in exposed):
            out["exposed_s_median"] = statistics.median(exposed)
            out["exposed_fraction"] = sum(exposed) / sum(step_times)
        peaks = [s.get("full_bytes_peak") for s in self.steps if isinstance(s, dict)]
        if peaks and all(isinstance(p, (int, float)) for p in peaks):
            out["full_bytes_peak"] = max(peaks)
        return out


def _jsonable(x: Any) -> Any:
    if hasattr(x, "__dataclass_fields__"):
        x = asdict(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return repr(x)


# -- a rank --------------------------------------------------------------------------------


def rank_main(
    rank: int,
    world: int,
    system: str,
    precision: str,
    cfg: BenchConfig,
    init_file: str,
    out_dir: str,
) -> None:
    """Entry point of one spawned rank: timed pass, then profiled pass; result as JSON."""
    torch.set_num_threads(cfg.threads)
    os.environ["LOCAL_RANK"] = str(rank)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
        **({"device_id": device} if cuda else {}),
    )
    try:
        batches = make_batches(cfg, rank, cfg.warmup + cfg.steps, device)
        result = timed_pass(system, precision, cfg, device, batches)
        result["rss_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
        gc.collect()
        dist.barrier()
        result["memory"] = profiled_pass(system, precision, cfg, device, batches)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()
