"""One benchmark run on one rank: build the GPT, wrap it with one system, time it,
count its collectives and measure its memory. ``scripts/bench.py`` spawns the ranks.

Systems: ``fsdp_lite``, ``fsdp2`` (``fully_shard``), ``fsdp1`` (``FullyShardedDataParallel``)
and ``ddp``. Every system gets the same model (same seed, built before wrapping), the same
data, per-block units plus the root, and AdamW.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Any

import bench_measure as bm
import torch
import torch.distributed as dist
from torch import nn

import fsdp_lite
from fsdp_lite.testing.memory import MemoryRecorder
from fsdp_lite.testing.models import GPT, Block, GPTConfig, parallelize_gpt

SYSTEMS = ("fsdp_lite", "fsdp_lite-nocheck", "fsdp2", "fsdp1", "ddp")
# fsdp_lite-nocheck: fsdp_lite with its divergence check off, to price the check.
# fsdp_lite-orig / fsdp_lite-whole (not in SYSTEMS; bench_host uses them): the optimizer
# over pieces of the original parameters / whole parameters instead of flat shards.
LAYOUTS = {
    "fsdp_lite-orig": {"optimizer_params": "pieces"},
    "fsdp_lite-whole": {"optimizer_params": "whole"},
}
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class BenchConfig:
    """Everything a rank needs to run one (system, precision) case; picklable."""

    layers: int = 4
    dim: int = 256
    heads: int = 4
    seq: int = 256
    batch: int = 4  # sequences per rank per micro-batch
    # Micro-batches per optimizer step, accumulated as each system does best: fsdp_lite and
    # FSDP2 with set_requires_gradient_sync / set_reshard_after_backward(False) before the
    # last, FSDP1 and DDP under no_sync.
    micro: int = 1
    # Tensor-parallel degree: the GPT's Megatron plan (parallelize_gpt) on the tp dim of a
    # (dp, tp) mesh, the system sharding over dp (fsdp_lite and FSDP2 only).
    tp: int = 1
    vocab: int = 4096
    checkpoint: bool = False  # activation checkpointing of every block, in every system
    steps: int = 20  # timed steps
    warmup: int = 3
    profile_steps: int = 3  # steps of the profiled (memory) pass; the first is not counted
    threads: int = 1  # torch intra-op threads per rank
    seed: int = 1234
    lr: float = 1e-3
    timeout_s: float = 600.0  # a collective's, before the process group fails it

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
    dp_mesh = None
    if cfg.tp > 1:  # TP on the tp dim, the system over dp
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))
        parallelize_gpt(model, mesh["tp"])
        dp_mesh = mesh["dp"]
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
            mesh=dp_mesh,
            **LAYOUTS.get(system, {}),
        )
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = dp_mesh or init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = mp if bf16 else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)
    if cfg.tp > 1:
        raise ValueError(f"--tp: fsdp_lite and fsdp2 only, not {system}")
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


def make_batches(cfg: Any, rank: int, n: int, device: torch.device) -> list[tuple]:
    """``n`` (inputs, targets) batches of random tokens, the same for every system, from a
    config's seed, vocab, batch (times ``micro``, when it has one) and seq
    (``BenchConfig``, ``bench_muon.MuonBenchConfig``)."""
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    rows = cfg.batch * getattr(cfg, "micro", 1)
    tokens = torch.randint(cfg.vocab, (n, rows, cfg.seq + 1), generator=g)
    return [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in tokens]


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: tuple, autocast: bool, micro: int = 1
) -> torch.Tensor:
    """zero_grad, forward and backward of ``micro`` micro-batches (``batch`` split), AdamW
    step; returns the (detached) mean loss."""
    opt.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for i, (x, y) in enumerate(zip(*(t.chunk(micro) for t in batch), strict=True)):
        ctx = (
            torch.autocast(x.device.type, dtype=torch.bfloat16)
            if autocast
            else contextlib.nullcontext()
        )
        with ctx, _accumulating(model, last=i == micro - 1):
            _, loss = model(x, y)
            (loss / micro).backward()
        total += loss.detach().cpu() / micro
    opt.step()
    if batch[0].device.type == "cuda":
        torch.cuda.synchronize(batch[0].device)
    return total


def _accumulating(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """A micro-batch before the last (or the last) as each system accumulates best."""
    if hasattr(model, "set_requires_gradient_sync"):  # fsdp_lite, FSDP2
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last else model.no_sync()


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
        losses.append(train_step(model, opt, batches[i], autocast, cfg.micro).item())
    lib = bm.LibraryAccounting(system)
    times: list[float] = []
    cpu_times: list[float] = []
    with bm.count_collectives() as counts:
        for i in range(cfg.warmup, cfg.warmup + cfg.steps):
            lib.before_step()
            watch = bm.Stopwatch()
            loss = train_step(model, opt, batches[i], autocast, cfg.micro)
            times.append(watch.wall())
            cpu_times.append(watch.cpu())
            lib.after_step()
            losses.append(loss.item())
    return {
        "step_times_s": times,
        "step_cpu_s": cpu_times,
        "losses": losses,
        "comm_per_step": bm.per_step(counts, cfg.steps),
        "library": lib.summary(times, model),
        "num_params_local": sum(p.numel() for p in model.parameters()),
        # fsdp_lite: the root unit's own shards (its full params stay gathered for backward)
        "root_params_local": sum(p.numel() for p in model.parameters(recurse=False)),
    }


def profiled_pass(
    system: str, precision: str, cfg: BenchConfig, device: torch.device, batches: list
) -> dict[str, float]:
    """Build, wrap and train ``cfg.profile_steps`` steps under the profiler's allocator events.

    The profiler starts before the model exists, so the running sum of allocator events
    is the tensor memory live on this rank; the peak is taken inside the steps after the
    first (the first one allocates the optimizer state).
    """
    autocast = system == "ddp" and precision == "bf16"
    with MemoryRecorder(device) as rec:
        model = build_system(system, precision, cfg, device)
        opt = _make_optimizer(model, cfg)
        for i in range(cfg.profile_steps):
            with rec.step():
                train_step(model, opt, batches[i % len(batches)], autocast, cfg.micro)
        del model, opt
    return {"peak_bytes": float(rec.peak_bytes), "resident_bytes": float(rec.resident_bytes)}


# -- a rank --------------------------------------------------------------------------------


def rank_main(rank: int, world: int, system: str, precision: str, cfg: BenchConfig) -> dict:
    """One rank of a case (``fsdp_lite.testing.run_distributed`` runs it): timed pass,
    then profiled pass."""
    device = bm.rank_device()
    batches = make_batches(cfg, rank // cfg.tp, cfg.warmup + cfg.steps, device)  # by dp rank
    result = timed_pass(system, precision, cfg, device, batches)
    result["rss_peak_bytes"] = bm.max_rss_bytes()
    gc.collect()
    dist.barrier()
    result["memory"] = profiled_pass(system, precision, cfg, device, batches)
    return result
