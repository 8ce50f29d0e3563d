"""The memory planner's estimate for this run, printed beside the peak one step measures.

The estimate (``fsdp_lite.estimate_memory``) is made on a meta-device copy of the model
with this run's settings, before training. The measurement is of the second step of the
run (optimizer state exists by then): on CUDA the allocator's peak; on CPU the tensors
live when the step starts (shards, buffers, optimizer state) plus the highest total the
profiler's allocator events reach inside the step. Gloo frees some buffers on its own
threads, where the profiler does not see them, so on CPU with W > 1 the measurement runs
a little high.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from train_config import Config
from train_setup import DTYPES, Dist, _inner_model, _offload, _wrap_policy

import fsdp_lite
from fsdp_lite.planner.estimate import MemoryEstimate
from fsdp_lite.testing.memory import MemoryRecorder


def choose(cfg: Config, vocab_size: int, d: Dist) -> tuple[MemoryEstimate, str]:
    """How this run's micro-steps before the last run (``train.accumulate``; ``auto``:
    ``keep`` where its estimate fits this rank's share of the device, else ``no_sync``),
    and the planner's estimate for a step run so."""
    mode = cfg.train.accumulate
    if cfg.train.grad_accum == 1:
        return estimate(cfg, vocab_size, d, None), mode
    if mode != "auto":
        return estimate(cfg, vocab_size, d, mode), mode
    keep = estimate(cfg, vocab_size, d, "keep")
    if keep.peak_bytes <= _device_share(d.device):
        return keep, "keep"
    return estimate(cfg, vocab_size, d, "no_sync"), "no_sync"


def _device_share(device: torch.device) -> int:
    """What one rank may plan to use: 85% of its GPU, or of the host's memory over the
    node's ranks (the rest: the allocator's reserve and fragmentation, the process)."""
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
    else:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // ranks
    return int(0.85 * total)


def estimate(cfg: Config, vocab_size: int, d: Dist, accumulation: str | None) -> MemoryEstimate:
    """One rank's peak over a step of this run, as the planner predicts it, the
    micro-steps before the last run as ``accumulation`` says (None: one micro-step)."""
    f, t = cfg.fsdp, cfg.train
    if d.tp > 1:
        raise NotImplementedError("the planner does not model tensor parallelism (parallel.tp)")
    with torch.device("meta"):
        inner, blocks = _inner_model(cfg, vocab_size)
    policy = _wrap_policy(cfg, inner, blocks)  # applies activation checkpointing too
    dtype = DTYPES[f.mixed_precision]
    mp = None if dtype == torch.float32 else fsdp_lite.MixedPrecision(dtype, torch.float32)
    x = torch.zeros(t.batch_size, cfg.model.block_size, dtype=torch.long)
    shard_world = f.shard_size or d.world_size
    return fsdp_lite.estimate_memory(
        inner,
        (x, x) if cfg.model.hf is None else (x,),
        shard_world,
        auto_wrap_policy=policy,
        mixed_precision=mp,
        reshard_after_forward=f.reshard_after_forward,
        offload=_offload(cfg),
        prefetch=fsdp_lite.PrefetchPolicy(max_in_flight=f.prefetch + 1) if f.prefetch else None,
        loss_fn=_loss(cfg.model.hf is not None, x),
        device=d.device,
        backend="nccl" if d.device.type == "cuda" else "gloo",
        optimizer_params="whole" if cfg.optim.name == "muon" else "flat",
        grad_accumulation=accumulation if t.grad_accum > 1 else None,
    )


def _loss(hf: bool, y: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """``train_setup.lm_loss`` on the model's output."""
    if not hf:
        return lambda out: out[1]
    return lambda out: F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())


@contextlib.contextmanager
def measure_step(
    model: nn.Module, opts: list[torch.optim.Optimizer], device: torch.device
) -> Iterator[dict[str, int]]:
    """Yield a dict that holds ``peak_bytes`` of the step run inside, once it ends."""
    out: dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        return
    start = _live_tensor_bytes(model, opts)
    with MemoryRecorder("cpu") as rec:
        with rec.step():
            yield out
    out["peak_bytes"] = start + rec.peak_bytes


def _live_tensor_bytes(model: nn.Module, opts: list[torch.optim.Optimizer]) -> int:
    """Bytes of the tensors a step starts with: shards (and any grads), buffers, optimizer
    state, each storage once."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for o in opts for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def report(est: fsdp_lite.planner.estimate.MemoryEstimate, measured: int) -> str:
    mib = 2**20
    parts = ", ".join(f"{k} {v / mib:.1f}" for k, v in est.breakdown.items() if v)
    return (
        f"memory/rank: planner estimate {est.peak_bytes / mib:.1f} MiB (peak at {est.phase}; "
        f"{parts}), measured {measured / mib:.1f} MiB at step 2 "
        f"({100 * (est.peak_bytes / measured - 1):+.1f}%)"
    )
