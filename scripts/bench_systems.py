"""What the benchmarks compare: one GPT wrapped by each system, and one rank's run of it.

Systems: ``unwrapped`` (the GPT alone; bf16 under autocast), ``fsdp_lite`` and its
variants (``-nocheck``: the divergence check off, to price it; ``-pieces`` / ``-whole``:
the optimizer over pieces of the original parameters / whole parameters; ``-compiled``:
``fsdp_lite.compile_blocks`` before wrapping; ``-cpu`` / ``-ssd``: shards, grads and
AdamW state offloaded), ``fsdp2`` (``fully_shard``), ``fsdp1``
(``FullyShardedDataParallel``) and ``ddp``. Every system gets the same model (same seed,
built before wrapping), the same data, a unit per block plus the root, and AdamW.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import bench_harness as bh
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

import fsdp_lite
from fsdp_lite.testing.memory import MemoryRecorder, QuietProfile
from fsdp_lite.testing.models import GPT, Block, GPTConfig, parallelize_gpt

SYSTEMS = (
    "unwrapped", "fsdp_lite", "fsdp_lite-nocheck", "fsdp_lite-pieces", "fsdp_lite-whole",
    "fsdp_lite-compiled", "fsdp_lite-cpu", "fsdp_lite-ssd", "fsdp2", "fsdp1", "ddp",
)  # fmt: skip
PRECISIONS = ("fp32", "bf16")
_OPTIMIZER_PARAMS = {"fsdp_lite-pieces": "pieces", "fsdp_lite-whole": "whole"}


@dataclass(frozen=True)
class Config:
    """Everything a rank needs, for every scenario (each reads its own fields); picklable."""

    systems: str = "fsdp_lite,fsdp_lite-nocheck,fsdp2,fsdp1,ddp"
    precisions: str = "fp32,bf16"
    world_size: int = 2
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
    tied: bool = True  # the head shares the embedding's weight
    checkpoint: bool = False  # activation checkpointing of every block, in every system
    steps: int = 20  # timed steps per case per round
    warmup: int = 3  # first steps, timed apart
    rounds: int = 1  # every case again, interleaved
    profile_steps: int = 3  # steps of the memory pass; the first is not counted (0: none)
    profile_ops: int = 0  # rows of rank 0's torch.profiler op table after the timed steps
    threads: int = 0  # torch intra-op threads per rank (0: the cores over the ranks)
    adamw: str = "default"  # or "foreach" (CUDA's default), "loop" (CPU's), "fused"
    seed: int = 1234
    lr: float = 1e-3
    timeout_s: float = 600.0  # a case's, and a collective's before the group fails it
    worlds: str = "8,64,512"  # scale: simulated world sizes
    fake_world: int = 8  # muon: simulated ranks
    max_layout_world: int = 8  # muon: the layout table's W=2..this
    muon_lr: float = 0.02
    lora_rank: int = 8

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab, block_size=self.seq, n_layer=self.layers,
            n_head=self.heads, n_embd=self.dim, dropout=0.0, tie_weights=self.tied,
        )  # fmt: skip


# -- systems -----------------------------------------------------------------------------


def build(
    system: str, precision: str, cfg: Config, device: torch.device, meta: bool = False, **kw: Any
) -> nn.Module:
    """The GPT (seeded identically on every rank and system), wrapped by ``system``.
    ``meta``: built on meta and materialized by the system itself, unit by unit (fsdp_lite's
    deferred init, FSDP2's ``to_empty``), shards filled N(0, 0.02) locally. ``kw`` goes to
    ``FSDPModule`` (e.g. ``offload``)."""
    torch.manual_seed(cfg.seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = GPT(cfg.gpt_config())
    model = model if meta else model.to(device)
    if system == "fsdp_lite-compiled":
        fsdp_lite.compile_blocks(model, Block)
    if cfg.checkpoint and system in ("unwrapped", "fsdp2", "ddp"):  # before wrapping
        _checkpoint_blocks(model)
    model = _wrap(system, precision, cfg, model, device, meta, **kw)
    if cfg.checkpoint and system.startswith("fsdp_lite"):  # ckpt(unit(block))
        fsdp_lite.apply_activation_checkpointing(
            model, lambda m: isinstance(m, fsdp_lite.FSDPModule) and m is not model
        )
    elif cfg.checkpoint and system == "fsdp1":  # inside each FSDP unit, the usual recipe
        _checkpoint_blocks(model)
    if meta:
        shards = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        with torch.no_grad():
            for s in shards:
                s.normal_(std=0.02)
    return model


def _checkpoint_blocks(model: nn.Module) -> None:
    """Every block behind torch's (non-reentrant) checkpoint wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


def _wrap(
    system: str, precision: str, cfg: Config, model: GPT, device: torch.device, meta: bool, **kw
) -> nn.Module:
    bf16 = precision == "bf16"
    world = dist.get_world_size() if dist.is_initialized() else 1
    dp_mesh = None
    if cfg.tp > 1:  # TP on the tp dim, the system over dp
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))
        parallelize_gpt(model, mesh["tp"])
        dp_mesh = mesh["dp"]
    if system == "unwrapped":
        return model
    if system.startswith("fsdp_lite"):
        from fsdp_lite.build.deferred_init import no_init

        fsdp_lite.core.divergence.set_divergence_check("off" if "nocheck" in system else "cheap")
        mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = {"fsdp_lite-cpu": fsdp_lite.CPUOffload()}.get(system)
        return fsdp_lite.FSDPModule(
            model,
            auto_wrap_policy=fsdp_lite.wrap.by_type(Block),
            mixed_precision=mp if bf16 else None,
            device=device,
            mesh=dp_mesh,
            optimizer_params=_OPTIMIZER_PARAMS.get(system, "flat"),
            **({"param_init_fn": no_init} if meta else {}),
            **({"offload": offload} if offload else {}),
            **kw,
        )
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = dp_mesh or init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = mp if bf16 else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        model = fully_shard(model, mesh=mesh, mp_policy=policy)
        return model.to_empty(device=device) if meta else model
    if cfg.tp > 1 or meta:
        raise ValueError(f"--tp and meta builds: fsdp_lite and fsdp2 only, not {system}")
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


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    impl = {"default": {}, "foreach": {"foreach": True}, "loop": {"foreach": False},
            "fused": {"fused": True}}  # fmt: skip
    if cfg.adamw not in impl:
        raise ValueError(f"--adamw: unknown {cfg.adamw!r}; choose from {', '.join(impl)}")
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1, **impl[cfg.adamw])


def make_batches(cfg: Config, rank: int, n: int, device: torch.device) -> list[tuple]:
    """``n`` (inputs, targets) batches of random tokens, the same for every system."""
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    tokens = torch.randint(cfg.vocab, (n, cfg.batch * cfg.micro, cfg.seq + 1), generator=g)
    return [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in tokens]


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: tuple, autocast: bool, micro: int = 1
) -> torch.Tensor:
    """zero_grad, forward and backward of ``micro`` micro-batches (``batch`` split), AdamW
    step, each phase a profiler region; returns the (detached) mean loss."""
    opt.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for i, (x, y) in enumerate(zip(*(t.chunk(micro) for t in batch), strict=True)):
        ctx = torch.autocast(x.device.type, dtype=torch.bfloat16) if autocast else None
        with ctx or contextlib.nullcontext(), _accumulating(model, last=i == micro - 1):
            with record_function("bench::forward"):
                _, loss = model(x, y)
            with record_function("bench::backward"):
                (loss / micro).backward()
        total += loss.detach().cpu() / micro
    with record_function("bench::optimizer"):
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
    return model.no_sync() if not last and hasattr(model, "no_sync") else contextlib.nullcontext()


# -- one rank of a case ------------------------------------------------------------------


def run_rank(rank: int, world: int, system: str, precision: str, cfg: Config) -> dict[str, Any]:
    """One rank of a case (``fsdp_lite.testing.run_distributed`` runs it): the timed pass,
    then the memory pass."""
    device = bh.rank_device()
    batches = make_batches(cfg, rank // cfg.tp, cfg.warmup + cfg.steps, device)  # by dp rank
    result = _timed_pass(system, precision, cfg, device, batches)
    gc.collect()
    dist.barrier()
    if cfg.profile_steps:
        result["memory"] = _memory_pass(system, precision, cfg, device, batches)
    return result


@contextlib.contextmanager
def _trainable(
    system: str, precision: str, cfg: Config, device: torch.device
) -> Iterator[tuple[nn.Module, torch.optim.Optimizer]]:
    """The wrapped model and its AdamW (``-ssd``: both on files in a temporary directory)."""
    with tempfile.TemporaryDirectory(prefix="fsdp_bench_ssd_") as tmp:
        kw = {"offload": fsdp_lite.SSDOffload(tmp)} if system == "fsdp_lite-ssd" else {}
        model = build(system, precision, cfg, device, **kw)
        opt = make_optimizer(model, cfg)
        if kw:
            fsdp_lite.offload_optimizer_state(opt, model)
        yield model, opt
        del model, opt


def _timed_pass(
    system: str, precision: str, cfg: Config, device: torch.device, batches: list
) -> dict[str, Any]:
    """``cfg.warmup`` first steps, then ``cfg.steps`` steps with their collectives counted
    and fsdp_lite's own accounting read; RSS between steps and in the last step."""
    with _trainable(system, precision, cfg, device) as (model, opt):
        return _steps(system, precision, cfg, model, opt, batches)


def _steps(
    system: str, precision: str, cfg: Config, model: nn.Module, opt: Any, batches: list
) -> dict[str, Any]:
    autocast = system in ("ddp", "unwrapped") and precision == "bf16"
    lib = system.startswith("fsdp_lite")
    out: dict[str, Any] = {"first_steps_s": [], "step_times_s": [], "step_cpu_s": [], "losses": []}
    out["graphs_after_warmup"] = _graphs()
    exposed, full_peak, counts = [], [], bh.new_counts()
    for i, batch in enumerate(batches):
        timed = i >= cfg.warmup
        if i == len(batches) - 1:
            out["rss_peak_bytes"] = bh.rss_bytes("VmHWM")
            bh.reset_peak_rss()
        if lib:
            fsdp_lite.reset_stats(model)
        dist.barrier()  # every rank starts the step together: the slowest rank is the step
        with bh.count_collectives(counts) if timed else contextlib.nullcontext():
            watch = bh.Stopwatch()
            loss = train_step(model, opt, batch, autocast, cfg.micro)
            wall, cpu = watch.wall(), watch.cpu()
        out["step_times_s" if timed else "first_steps_s"].append(wall)
        if timed:
            out["step_cpu_s"].append(cpu)
        out["losses"].append(loss.item())
        if i == cfg.warmup - 1:
            out["graphs_after_warmup"] = _graphs()
        if lib and timed:
            s = fsdp_lite.stats(model)
            exposed.append(s["exposed_s"])
            full_peak.append(s["full_bytes_peak"])
            out["library"] = {"last_step": s, "memory_stats": model.memory_stats()}
    opt.zero_grad(set_to_none=True)  # between steps: the grads are freed
    out["rss_between_bytes"] = bh.rss_bytes()
    out["rss_peak_last_step_bytes"] = bh.rss_bytes("VmHWM")
    out["graphs_at_end"] = _graphs()
    out["comm_per_step"] = bh.per_step(counts, cfg.steps)
    if lib:
        out["library"] |= {
            "exposed_s_median": statistics.median(exposed),
            "exposed_fraction": sum(exposed) / sum(out["step_times_s"]),
            "full_bytes_peak": max(full_peak),
        }
    # This rank's shards (a DTensor's local part), and the root unit's own (fsdp_lite: its
    # full params stay gathered for backward)
    out["num_params_local"], out["root_params_local"] = (
        sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
        for params in (model.parameters(), model.parameters(recurse=False))
    )
    if cfg.profile_ops:
        with QuietProfile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for batch in batches[: cfg.warmup or 1]:
                train_step(model, opt, batch, autocast, cfg.micro)
        out["ops"] = prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=cfg.profile_ops, max_name_column_width=60
        )
    return out


def _graphs() -> int:
    """Graphs dynamo compiled in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _memory_pass(
    system: str, precision: str, cfg: Config, device: torch.device, batches: list
) -> dict[str, float]:
    """Build, wrap and train ``cfg.profile_steps`` steps under the profiler's allocator
    events: the profiler starts before the model exists, so the running sum of its events
    is the tensor memory live on this rank; the peak is taken inside the steps after the
    first (which allocates the optimizer state)."""
    autocast = system in ("ddp", "unwrapped") and precision == "bf16"
    with MemoryRecorder(device) as rec, _trainable(system, precision, cfg, device) as (m, opt):
        for i in range(cfg.profile_steps):
            with rec.step():
                train_step(m, opt, batches[i % len(batches)], autocast, cfg.micro)
    return {"peak_bytes": float(rec.peak_bytes), "resident_bytes": float(rec.resident_bytes)}
