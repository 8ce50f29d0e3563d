"""Train a small character-level GPT (or a Hugging Face causal LM) with fsdp_lite.

    torchrun --standalone --nproc_per_node=2 scripts/train.py --config configs/tiny.yaml \\
        [--set train.steps=100 fsdp.mixed_precision=bf16 ...] [--resume [PATH] | --overwrite]

NCCL on cuda:LOCAL_RANK if CUDA is available, else gloo on CPU; one rank without torchrun.
The pieces: ``train_config`` (keys, overrides, validation), ``train_data`` (corpus and
batches), ``train_setup`` (process group, wrapped model, schedule), ``train_ckpt``
(checkpoints and resume), ``train_log`` (progress, TensorBoard, summary). This file is
the loop. Exit codes: 2 for a bad config or a fresh run where an earlier run of its name
left checkpoints (``--resume`` or ``--overwrite``), 1 when a peer rank died (torchrun
``--max-restarts`` then restarts the job, which resumes from the latest checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import train_ckpt
import train_memory
from train_config import Config, ConfigError, load_config
from train_data import Batches, Corpus, load_data
from train_log import (
    LOCAL_FIELDS,
    RunLog,
    StepMetrics,
    cfg_tokens,
    gather_rows,
    peak_memory_bytes,
    summarize,
)
from train_setup import (
    Dist,
    build_model,
    build_optimizers,
    init_distributed,
    lm_loss,
    lr_at,
    world_size_from_env,
)

import fsdp_lite


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
        self.accumulate = "no_sync"  # until train_memory.choose says
        self.batches = Batches(
            data, cfg.model.block_size, t.batch_size, d.dp_rank, d.dp_size, t.seed
        )

    def local_state(self) -> dict:
        """What this rank needs, besides model and optimizer, to resume (see train_ckpt)."""
        return {"data": self.batches.state_dict(), "scaler": self.scaler.state_dict()}

    def load_local_state(self, state: dict) -> None:
        self.batches.load_state_dict(state["data"])
        if state["scaler"]:  # empty when saved without fp16: start from init_scale
            self.scaler.load_state_dict(state["scaler"])

    def step(self, lr: float, crash: bool) -> StepMetrics:
        """Forward and backward over ``grad_accum`` micro-batches (those before the last as
        ``self.accumulate`` says: ``train_memory.choose``), clip, optimizer step.
        ``crash``: die after backward (debug)."""
        t, d, model, start = self.cfg.train, self.d, self.model, time.perf_counter()
        for opt, peaks in zip(self.opts, self.peaks, strict=True):  # train.lr's schedule
            for group, peak in zip(opt.param_groups, peaks, strict=True):
                group["lr"] = peak * lr / t.lr
        fsdp_lite.reset_stats()
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
        stats = fsdp_lite.stats()  # read before our own all-gather below
        local = [loss_sum.item(), peak_memory_bytes(d.device), stats["full_bytes_peak"]]
        rows = gather_rows(local + [stats["exposed_s"]], d)  # (W, 4)
        ranks = {k: rows[:, i].tolist() for i, k in enumerate(LOCAL_FIELDS) if i}
        loss = rows[:, 0].sum().item() / (t.grad_accum * d.world_size)
        return StepMetrics(loss, norm.item(), not finite, seconds, stats["collectives"], ranks)


def _crash_now(cfg: Config, step: int, d: Dist) -> bool:
    dbg = cfg.debug
    rank = d.world_size - 1 if dbg.crash_rank is None else dbg.crash_rank
    return dbg.crash_at_step == step and d.rank == rank and train_ckpt.restart_count() == 0


def _start(trainer: Trainer, cfg: Config, d: Dist) -> tuple[int, str]:
    """Resume from a checkpoint, if any; returns (last step done, note)."""
    source = train_ckpt.resume_source(cfg)
    if source is None:
        return 0, "starting fresh"
    step, local, note = train_ckpt.restore(source, trainer.model, trainer.opts, cfg, d)
    trainer.load_local_state(local)
    return step, note


def train(
    cfg: Config, data: Corpus, d: Dist, tokenizer: Any | None = None, start_note: str = ""
) -> None:
    trainer = Trainer(cfg, data, d)
    done, note = _start(trainer, cfg, d)
    t, every = cfg.train, cfg.checkpoint.every
    run_log = RunLog(cfg, d, done + 1, cfg_tokens(cfg, d))
    attempt = train_ckpt.restart_count()
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
        ctx = train_memory.measure_step(trainer.model, trainer.opts, d.device)
        with ctx if measure else contextlib.nullcontext({}) as peak:
            r = trainer.step(lr, crash=_crash_now(cfg, step, d))
        if measure:
            run_log.note(train_memory.report(est, peak["peak_bytes"]))
        results.append(r)
        scale = trainer.scaler.get_scale() if trainer.scaler.is_enabled() else None
        run_log.step(step, r, lr, scale)
        if every and (step % every == 0 or step == t.steps):
            path = train_ckpt.save(cfg, step, trainer.model, trainer.opts, trainer.local_state(), d)
            run_log.note(f"step {step:5d}/{t.steps} | checkpoint {path}")
    run_log.close()
    wall = time.perf_counter() - start
    summarize(cfg, trainer.model, trainer.n_params, results, d, wall, trainer.accumulate)
    if trainer.hf and cfg.checkpoint.export_hf:
        import train_hf

        out = train_hf.export(train_ckpt.hf_export_dir(cfg), trainer.model, tokenizer, d.rank)
        run_log.note(f"final model (Hugging Face format) saved to {out}")


def _planner_estimate(
    cfg: Config, vocab_size: int, d: Dist, run_log: RunLog, trainer: Trainer
) -> fsdp_lite.planner.estimate.MemoryEstimate | None:
    """``fsdp_lite.estimate_memory`` for this run, or None (said in the log) if it cannot;
    sets how the trainer runs micro-steps (``train_memory.choose``; ``no_sync`` for
    ``auto`` without an estimate)."""
    mode = cfg.train.accumulate
    trainer.accumulate = "no_sync" if mode == "auto" else mode
    try:
        est, trainer.accumulate = train_memory.choose(cfg, vocab_size, d)
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
    import train_hf  # imports transformers

    src = train_hf.hf_source(cfg.model.hf)
    hf_config = train_hf.load_hf_config(src)
    tokenizer = train_hf.load_tokenizer(src)
    data = load_data(cfg, world, tokenizer)
    max_id = int(data.data.max())
    train_hf.check_vocab(cfg, hf_config, data.vocab_size, max_id, tokenizer)
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
        start_note = train_ckpt.prepare_start(cfg, args.overwrite, int(os.environ.get("RANK", 0)))
        data, tokenizer = _load_data(cfg, world // cfg.parallel.tp)  # the data-parallel ranks
        d = init_distributed(cfg.fsdp.timeout_s, cfg.parallel.tp)
    except ConfigError as e:
        if rank0:
            print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except train_ckpt.RunExistsError as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
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


if __name__ == "__main__":
    main()
