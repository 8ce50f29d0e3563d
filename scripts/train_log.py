"""The training script's reporting: per-step metrics from every rank, stdout, progress bar,
TensorBoard scalars (rank 0) and the end-of-run summary.

Each step, every rank contributes ``StepMetrics.local`` (loss, peak memory, exposed
communication) in one small all-gather issued after ``fsdp_lite.stats()`` was read, so
it is not counted as the model's communication.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
from train_config import Config
from train_setup import DTYPES, Dist

import fsdp_lite

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
    comm: dict[str, dict]  # fsdp_lite.stats()["collectives"] of this step (this rank)
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
