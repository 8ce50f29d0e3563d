"""Train a small character-level GPT (or a Hugging Face causal LM) with fsdp_lite.

    torchrun --standalone --nproc_per_node=2 scripts/train.py --config configs/tiny.yaml \
        [--set train.steps=100 fsdp.mixed_precision=bf16 ...] [--resume [PATH] | --overwrite]

NCCL on cuda:LOCAL_RANK if CUDA is available, else gloo on CPU; one rank without torchrun.
Three files: ``train_config`` (keys, overrides, validation; the corpus and batches),
``train_setup`` (process group, wrapped model, schedule, Hugging Face models, checkpoints
and resume), and this one: the loop, its reporting (progress, TensorBoard, summary) and
the planner's estimate beside the measured peak. Exit codes: 2 for a bad config or a
fresh run where an earlier run of its name left checkpoints (``--resume`` or
``--overwrite``), 1 when a peer rank died (torchrun ``--max-restarts`` then restarts the
job, which resumes from the latest checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
from train_config import Batches, Config, ConfigError, Corpus, load_config, load_data
from train_setup import (
    DTYPES,
    Dist,
    RunExistsError,
    _inner_model,
    _offload,
    _wrap_policy,
    build_model,
    build_optimizers,
    check_vocab,
    export_hf,
    hf_export_dir,
    hf_source,
    init_distributed,
    lm_loss,
    load_hf_config,
    load_tokenizer,
    lr_at,
    prepare_start,
    restart_count,
    restore_checkpoint,
    resume_source,
    save_checkpoint,
    world_size_from_env,
)

import fsdp_lite
from fsdp_lite.planner.estimate import MemoryEstimate
from fsdp_lite.testing.memory import MemoryRecorder, storage_bytes


class Trainer:
    """The model, optimizer, data and loss scale of one run, and one optimizer step."""

    def __init__(self, cfg: Config, data: Corpus, d: Dist) -> None:
        self.cfg, self.d, self.hf = cfg, d, cfg.model.hf is not None
        self.model, self.n_params = build_model(cfg, data.vocab_size, d)
        self.opts = build_optimizers(cfg, self.model)
        # Each group's peak rate, from the config (a resumed checkpoint's groups carry the
        # rates of the step it was saved at).
        self.peaks = [[g["lr"] for g in opt.param_groups] for opt in self.opts]
        # fp16: dynamic loss scaling whose ranks agree on overflow (a no-op otherwise).
        self.scaler = fsdp_lite.ShardedGradScaler(
            d.device.type,
            init_scale=2.0**12,
            growth_interval=200,
            enabled=cfg.fsdp.mixed_precision == "fp16",
        )
        t = cfg.train
        self.accumulate = "no_sync"  # until choose_accumulation says
        self.batches = Batches(
            data, cfg.model.block_size, t.batch_size, d.dp_rank, d.dp_size, t.seed
        )

    def local_state(self) -> dict:
        """What this rank needs, besides model and optimizer, to resume
        (``save_checkpoint``)."""
        return {"data": self.batches.state_dict(), "scaler": self.scaler.state_dict()}

    def load_local_state(self, state: dict) -> None:
        self.batches.load_state_dict(state["data"])
        if state["scaler"]:  # empty when saved without fp16: start from init_scale
            self.scaler.load_state_dict(state["scaler"])

    def step(self, lr: float, crash: bool) -> StepMetrics:
        """Forward and backward over ``grad_accum`` micro-batches (those before the last as
        ``self.accumulate`` says: ``choose_accumulation``), clip, optimizer step.
        ``crash``: die after backward (debug)."""
        t, d, model, start = self.cfg.train, self.d, self.model, time.perf_counter()
        for opt, peaks in zip(self.opts, self.peaks, strict=True):  # train.lr's schedule
            for group, peak in zip(opt.param_groups, peaks, strict=True):
                group["lr"] = peak * lr / t.lr
        fsdp_lite.reset_stats(model)
        if d.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=d.device)
        for micro in range(t.grad_accum):
            x, y = (v.to(d.device) for v in self.batches.next())  # each (B, T)
            last = micro == t.grad_accum - 1
            model.set_requires_gradient_sync(last or self.accumulate == "sync")
            model.set_reshard_after_backward(last or self.accumulate != "keep")
            loss = lm_loss(model, x, y, self.hf)
            self.scaler.scale(loss * (1.0 / t.grad_accum)).backward()
            loss_sum += loss.detach().double()
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)  # like the OOM killer: no cleanup at all
        for opt in self.opts:
            self.scaler.unscale_(opt)
        norm = model.clip_grad_norm_(t.grad_clip if t.grad_clip > 0 else math.inf)
        finite = bool(torch.isfinite(norm))  # the global norm: every rank agrees
        for opt in self.opts if finite else ():
            self.scaler.step(opt)
        self.scaler.update()  # fp16: backs off if any rank found an inf/nan
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        stats = fsdp_lite.stats(model)  # read before our own all-gather below
        local = [loss_sum.item(), peak_memory_bytes(d.device), stats["full_bytes_peak"]]
        rows = gather_rows(local + [stats["exposed_s"]], d)  # (W, 4)
        ranks = {k: rows[:, i].tolist() for i, k in enumerate(LOCAL_FIELDS) if i}
        loss = rows[:, 0].sum().item() / (t.grad_accum * d.world_size)
        return StepMetrics(loss, norm.item(), not finite, seconds, stats["collectives"], ranks)


def _crash_now(cfg: Config, step: int, d: Dist) -> bool:
    dbg = cfg.debug
    rank = d.world_size - 1 if dbg.crash_rank is None else dbg.crash_rank
    return dbg.crash_at_step == step and d.rank == rank and restart_count() == 0


def _start(trainer: Trainer, cfg: Config, d: Dist) -> tuple[int, str]:
    """Resume from a checkpoint, if any; returns (last step done, note)."""
    source = resume_source(cfg)
    if source is None:
        return 0, "starting fresh"
    step, local, note = restore_checkpoint(source, trainer.model, trainer.opts, cfg, d)
    trainer.load_local_state(local)
    return step, note


def train(
    cfg: Config, data: Corpus, d: Dist, tokenizer: Any | None = None, start_note: str = ""
) -> None:
    trainer = Trainer(cfg, data, d)
    done, note = _start(trainer, cfg, d)
    t, every = cfg.train, cfg.checkpoint.every
    run_log = RunLog(cfg, d, done + 1, cfg_tokens(cfg, d))
    attempt = restart_count()
    run_log.note(
        f"{cfg.name}: {d.world_size} rank(s) on {d.device}, vocab {data.vocab_size}, "
        f"{cfg_tokens(cfg, d):,} tokens/step, {cfg.fsdp.mixed_precision}, "
        f"TensorBoard: {run_log.run_dir}" + (f", restart {attempt}" if attempt else "")
    )
    run_log.note(note + (f"; {start_note}" if start_note else ""))
    if done >= t.steps:
        run_log.note(f"nothing to do: the checkpoint is at step {done} of train.steps={t.steps}")
    est = _planner_estimate(cfg, data.vocab_size, d, run_log, trainer)
    results: list[StepMetrics] = []
    start = time.perf_counter()
    for step in range(done + 1, t.steps + 1):
        lr = lr_at(step - 1, t)
        measure = est is not None and step == done + 2  # optimizer state exists by now
        ctx = measure_step(trainer.model, trainer.opts, d.device)
        with ctx if measure else contextlib.nullcontext({}) as peak:
            r = trainer.step(lr, crash=_crash_now(cfg, step, d))
        if measure:
            run_log.note(memory_report(est, peak["peak_bytes"]))
        results.append(r)
        scale = trainer.scaler.get_scale() if trainer.scaler.is_enabled() else None
        run_log.step(step, r, lr, scale)
        if every and (step % every == 0 or step == t.steps):
            path = save_checkpoint(cfg, step, trainer.model, trainer.opts, trainer.local_state(), d)
            run_log.note(f"step {step:5d}/{t.steps} | checkpoint {path}")
    run_log.close()
    wall = time.perf_counter() - start
    summarize(cfg, trainer.model, trainer.n_params, results, d, wall, trainer.accumulate)
    if trainer.hf and cfg.checkpoint.export_hf:
        out = export_hf(hf_export_dir(cfg), trainer.model, tokenizer, d.rank)
        run_log.note(f"final model (Hugging Face format) saved to {out}")


def _planner_estimate(
    cfg: Config, vocab_size: int, d: Dist, run_log: RunLog, trainer: Trainer
) -> fsdp_lite.planner.estimate.MemoryEstimate | None:
    """``fsdp_lite.estimate_memory`` for this run, or None (said in the log) if it cannot;
    sets how the trainer runs micro-steps (``choose_accumulation``; ``no_sync`` for
    ``auto`` without an estimate)."""
    mode = cfg.train.accumulate
    trainer.accumulate = "no_sync" if mode == "auto" else mode
    try:
        est, trainer.accumulate = choose_accumulation(cfg, vocab_size, d)
    except Exception as e:  # the estimate is advice: a run it cannot model still trains
        run_log.note(f"memory/rank: no planner estimate ({type(e).__name__}: {e})")
        est = None
    if cfg.train.grad_accum > 1:
        run_log.note(f"micro-steps before the last: {trainer.accumulate} (train.accumulate={mode})")
    return est


def _load_data(cfg: Config, world: int) -> tuple[Corpus, Any | None]:
    """The corpus and, with ``model.hf``, the HF tokenizer (None: characters are tokens),
    checked against the HF model's vocabulary and positions."""
    if cfg.model.hf is None:
        return load_data(cfg, world), None

    src = hf_source(cfg.model.hf)
    hf_config = load_hf_config(src)
    tokenizer = load_tokenizer(src)
    data = load_data(cfg, world, tokenizer)
    max_id = int(data.data.max())
    check_vocab(cfg, hf_config, data.vocab_size, max_id, tokenizer)
    return data, tokenizer


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML run config (see configs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="extend",
        nargs="+",
        default=[],
        metavar="K=V",
        help="override config keys, e.g. --set train.steps=100 model.n_layer=2",
    )
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="PATH",
        help="continue from the latest complete checkpoint (or from PATH)",
    )
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="start over: delete the checkpoints (and HF export) an earlier run of this name "
        "left, the one way they are removed; without it a fresh run refuses to start there",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    world = world_size_from_env()
    overrides = args.overrides + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        cfg = load_config(args.config, overrides, world)
        start_note = prepare_start(cfg, args.overwrite, int(os.environ.get("RANK", 0)))
        data, tokenizer = _load_data(cfg, world // cfg.parallel.tp)  # the data-parallel ranks
        d = init_distributed(cfg.fsdp.timeout_s, cfg.parallel.tp)
    except (ConfigError, RunExistsError) as e:
        # Every rank refuses alike; rank 0 says why and fails the job. The others leave
        # without failing: torchrun stops every worker at the first failure, and one that
        # came before rank 0's could cut its message off.
        if rank0:
            what = "config error" if isinstance(e, ConfigError) else "error"
            print(f"{what}: {e}", file=sys.stderr, flush=True)
        sys.exit(2 if rank0 else 0)
    try:
        train(cfg, data, d, tokenizer, start_note)
    except fsdp_lite.CheckpointError as e:  # e.g. --resume from another model's checkpoint
        print(f"rank {d.rank}: checkpoint error: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    except (fsdp_lite.PeerError, dist.DistError) as e:
        # A peer died or hung: say so and leave at once (tearing the group down could wait
        # on the dead peer). torchrun --max-restarts restarts the job from a checkpoint.
        print(f"rank {d.rank}: a peer rank is gone, exiting: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    # Free the model (its units form reference cycles) while the process group is alive,
    # then leave together: no collective object outlives the group into interpreter exit.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


# -- reporting: per-step metrics, progress, TensorBoard, summary -------------------


LOCAL_FIELDS = ("loss_sum", "peak_bytes", "full_params_peak_bytes", "exposed_s")


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: CUDA bytes allocated since the last reset, or peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def gather_rows(values: list[float], d: Dist) -> torch.Tensor:
    """(world_size, len(values)) float64: every rank's ``values`` (only a few numbers)."""
    mine = torch.tensor(values, dtype=torch.float64, device=d.device)
    if d.world_size == 1:
        return mine[None].cpu()
    rows = [torch.empty_like(mine) for _ in range(d.world_size)]
    dist.all_gather(rows, mine)
    return torch.stack(rows).cpu()


@dataclass
class StepMetrics:
    loss: float  # mean over micro-batches and ranks
    grad_norm: float  # before clipping
    skipped: bool  # non-finite grads (fp16 overflow): no optimizer step
    seconds: float
    comm: dict[str, dict]  # fsdp_lite.stats(model)["collectives"] of this step (this rank)
    ranks: dict[str, list[float]]  # LOCAL_FIELDS other than loss_sum, one value per rank

    @property
    def comm_bytes(self) -> int:
        return sum(op["bytes"] for op in self.comm.values())


def log(msg: str) -> None:
    tqdm.write(msg)
    sys.stdout.flush()


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


class RunLog:
    """Rank 0's output for one run: progress bar, stdout lines, TensorBoard scalars."""

    def __init__(self, cfg: Config, d: Dist, first_step: int, tokens_per_step: int) -> None:
        self.cfg, self.d, self.tokens = cfg, d, tokens_per_step
        self.run_dir = Path(cfg.log.dir) / cfg.name
        self.writer = None
        if d.rank == 0 and cfg.log.tensorboard:
            # purge_step: TensorBoard drops events of this run's earlier attempts from
            # first_step on, so a resumed run's curve continues without duplicates.
            self.writer = SummaryWriter(str(self.run_dir), purge_step=first_step)
            self.writer.add_text("config", f"```\n{yaml.safe_dump(cfg.to_dict())}```")
        disable = True if d.rank else (None if cfg.log.progress is None else not cfg.log.progress)
        self.bar = tqdm(
            total=cfg.train.steps, initial=first_step - 1, disable=disable, dynamic_ncols=True
        )

    def step(self, step: int, r: StepMetrics, lr: float, loss_scale: float | None) -> None:
        if self.d.rank:
            return
        tps = self.tokens / r.seconds
        peak = max(r.ranks["peak_bytes"])
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{r.loss:.4f}", tok_s=f"{tps:,.0f}", mem=_mb(peak))
        if self.writer is not None:
            self._scalars(step, r, lr, tps, loss_scale)
        t = self.cfg.train
        if step == 1 or step % t.log_every == 0 or step == t.steps:
            note = "  (non-finite grads: step skipped)" if r.skipped else ""
            log(
                f"step {step:5d}/{t.steps} | loss {r.loss:.4f} | lr {lr:.2e} | "
                f"grad_norm {r.grad_norm:.3f} | {tps:,.0f} tok/s | peak mem {_mb(peak)} | "
                f"comm {_mb(r.comm_bytes)}/step{note}"
            )

    def _scalars(self, step: int, r: StepMetrics, lr: float, tps: float, scale: float | None):
        scalars = {"loss": r.loss, "lr": lr, "grad_norm": r.grad_norm, "tokens_per_s": tps}
        scalars["comm/bytes_per_step"] = r.comm_bytes
        scalars |= {f"comm/{op}_bytes": s["bytes"] for op, s in r.comm.items()}
        for name, values in r.ranks.items():
            prefix = "comm/exposed_s" if name == "exposed_s" else f"memory/{name}"
            scalars |= {f"{prefix}/rank{i}": v for i, v in enumerate(values)}
        if scale is not None:
            scalars["loss_scale"] = scale
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def note(self, msg: str) -> None:
        if self.d.rank == 0:
            log(msg)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()


def theoretical_comm(
    cfg: Config, model: fsdp_lite.FSDPModule, n_params: int, d: Dist, accumulate: str
) -> tuple[int, str]:
    """(bytes per step per rank, formula): what DESIGN.md says one step moves, counted as
    fsdp_lite counts it (the full buffer each collective spans), for Psi = ``n_params``;
    micro-steps before the last run as ``accumulate`` says (``Trainer.accumulate``)."""
    f, accum = cfg.fsdp, cfg.train.grad_accum
    shard_world = f.shard_size or d.dp_size
    if d.dp_size == 1:
        return 0, "nothing at data-parallel size 1"
    if d.tp > 1:  # each rank's units hold its local tensors: about Psi / tp of them
        n_params = sum(p.numel() for p in model.parameters()) * shard_world
    total, parts = 0, []
    if shard_world > 1:
        if f.reshard_after_forward is False:  # backward reuses every forward gather
            gathers, what = n_params, "1 gather"
        elif f.reshard_after_forward is None:  # the root stays gathered for backward
            root = model.parameters(recurse=False)
            gathers = 2 * n_params - sum(p.numel() for p in root) * shard_world
            what = "2 gathers (the root's once)"
        else:
            gathers, what = 2 * n_params, "2 gathers"
        # "keep": gathered at the first micro-step, kept to the last (which gathers again
        # what it reshards after forward, as one micro-step does)
        gathered = 1 if accum == 1 or accumulate == "keep" else accum
        reduced = accum if accumulate == "sync" else 1
        total += gathered * gathers * DTYPES[f.mixed_precision].itemsize + reduced * n_params * 4
        micro = f" x {accum} micro-steps" if gathered > 1 else ""
        if accum > 1 and accumulate == "keep":
            micro = f" (kept across {accum} micro-steps)"
        scatters = f"{reduced} reduce-scatter" + ("s" if reduced > 1 else "")
        parts.append(f"{what} in {f.mixed_precision}{micro} + {scatters} in fp32")
    if shard_world < d.dp_size:
        total += n_params // shard_world * 4
        parts.append("1 all-reduce of the shard grads across replicas in fp32")
    local = f" on this rank (parallel.tp={d.tp})" if d.tp > 1 else ""
    return total, " + ".join(parts) + f" of Psi = {n_params:,} params{local}"


def summarize(
    cfg: Config,
    model,
    n_params: int,
    results: list[StepMetrics],
    d: Dist,
    wall: float,
    accumulate: str,
):
    """Print the end-of-run summary and write ``summary.json`` next to the TensorBoard
    events (rank 0). Every rank calls it (it gathers the ranks' memory figures)."""
    mem = model.memory_stats()
    rows = gather_rows([mem["shard_bytes"], peak_memory_bytes(d.device)], d)
    if d.rank or not results:
        return None
    steps = len(results)
    timed = results[1:] or results  # the first step includes lazy init
    tps = cfg_tokens(cfg, d) * len(timed) / sum(r.seconds for r in timed)
    theory, formula = theoretical_comm(cfg, model, n_params, d, accumulate)
    measured = results[-1].comm_bytes
    units = sum(isinstance(m, fsdp_lite.FSDPModule) for m in model.modules())
    exposed = sum(sum(r.ranks["exposed_s"]) for r in results)
    ranks = range(d.world_size)
    summary = {
        "parameters": n_params,
        "units": units,
        "shard_bytes_per_rank": [int(rows[i, 0]) for i in ranks],
        "peak_memory_bytes_per_rank": [int(rows[i, 1]) for i in ranks],
        "full_params_peak_bytes_per_rank": [
            max(r.ranks["full_params_peak_bytes"][i] for r in results) for i in ranks
        ],
        "comm_bytes_per_step": measured,
        "comm_bytes_theory": theory,
        "comm_by_op": {op: s["bytes"] for op, s in results[-1].comm.items()},
        "exposed_comm_s_per_step": exposed / steps / d.world_size,
        "tokens_per_s": tps,
        "first_loss": results[0].loss,
        "last_loss": results[-1].loss,
        "steps": steps,
        "wall_s": wall,
    }
    _print_summary(summary, formula, d)
    path = Path(cfg.log.dir) / cfg.name / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    return summary


def cfg_tokens(cfg: Config, d: Dist) -> int:
    """Tokens per optimizer step over all ranks."""
    t = cfg.train
    return t.batch_size * cfg.model.block_size * t.grad_accum * d.dp_size


def _print_summary(s: dict[str, Any], formula: str, d: Dist) -> None:
    per_rank = lambda key: ", ".join(_mb(v) for v in s[key])  # noqa: E731
    ratio = (
        s["comm_bytes_per_step"] / s["comm_bytes_theory"] if s["comm_bytes_theory"] else math.nan
    )
    ops = ", ".join(f"{op} {_mb(b)}" for op, b in sorted(s["comm_by_op"].items()))
    log("=" * 72)
    log(f"parameters        {s['parameters']:,} in {s['units']} FSDP units, {d.world_size} rank(s)")
    log(f"shard bytes/rank  {per_rank('shard_bytes_per_rank')} (fp32 shards)")
    log(
        f"peak memory/rank  {per_rank('peak_memory_bytes_per_rank')} "
        f"({'CUDA allocated' if d.device.type == 'cuda' else 'process RSS'}); "
        f"full params at most {per_rank('full_params_peak_bytes_per_rank')}"
    )
    log(f"comm bytes/step   {_mb(s['comm_bytes_per_step'])} per rank ({ops or 'none'})")
    log(f"  theory          {_mb(s['comm_bytes_theory'])} = {formula}: measured/theory {ratio:.3f}")
    log(
        f"exposed comm      {s['exposed_comm_s_per_step'] * 1e3:.1f} ms/step per rank "
        "(waiting on collectives compute did not hide)"
    )
    log(f"throughput        {s['tokens_per_s']:,.0f} tokens/s over all ranks")
    log(f"loss              first {s['first_loss']:.4f} -> last {s['last_loss']:.4f}")
    log(f"wall time         {s['wall_s']:.1f} s for {s['steps']} steps")


# -- the memory planner's estimate, and the peak one step measures -----------------


def choose_accumulation(cfg: Config, vocab_size: int, d: Dist) -> tuple[MemoryEstimate, str]:
    """How this run's micro-steps before the last run (``train.accumulate``; ``auto``:
    ``keep`` where its estimate fits this rank's share of the device, else ``no_sync``),
    and the planner's estimate for a step run so."""
    mode = cfg.train.accumulate
    if cfg.train.grad_accum == 1:
        return estimate_run(cfg, vocab_size, d, None), mode
    if mode != "auto":
        return estimate_run(cfg, vocab_size, d, mode), mode
    keep = estimate_run(cfg, vocab_size, d, "keep")
    if keep.peak_bytes <= _device_share(d.device):
        return keep, "keep"
    return estimate_run(cfg, vocab_size, d, "no_sync"), "no_sync"


def _device_share(device: torch.device) -> int:
    """What one rank may plan to use: 85% of its GPU, or of the host's memory over the
    node's ranks (the rest: the allocator's reserve and fragmentation, the process)."""
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
    else:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // ranks
    return int(0.85 * total)


def estimate_run(cfg: Config, vocab_size: int, d: Dist, accumulation: str | None) -> MemoryEstimate:
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
    return storage_bytes(tensors)


def memory_report(est: fsdp_lite.planner.estimate.MemoryEstimate, measured: int) -> str:
    mib = 2**20
    parts = ", ".join(f"{k} {v / mib:.1f}" for k, v in est.breakdown.items() if v)
    return (
        f"memory/rank: planner estimate {est.peak_bytes / mib:.1f} MiB (peak at {est.phase}; "
        f"{parts}), measured {measured / mib:.1f} MiB at step 2 "
        f"({100 * (est.peak_bytes / measured - 1):+.1f}%)"
    )


if __name__ == "__main__":
    main()
