"""fsdp_lite's benchmarks, side by side with PyTorch's FSDP2, FSDP1 and DDP: scenarios of
one harness (``bench_harness``: timing, counting, reporting; ``bench_systems``: the
systems and one rank's run).

    .venv/bin/python scripts/bench.py SCENARIO [--flag value ...] [--no-write]
    make bench-SCENARIO [ARGS='--steps 10']          (make bench: step, host, scale, compile)

``bench.py SCENARIO --help`` lists a scenario's flags and defaults. Every case of the
step-like scenarios (step, accum, 2d, compile, offload) runs in freshly spawned ranks
(gloo on CPU; NCCL when every rank has a GPU) on the same model (same seed, built before
wrapping) and the same data; rounds interleave the cases, each round starting one later.
A step's time is its slowest rank's (the ranks start it together); ms/step is the median
over every timed step of every round. Peak tensor memory per rank comes from the
profiler's allocator events (``fsdp_lite.testing.MemoryRecorder``) in a separate short
pass, communication from the ProcessGroup collectives each rank issues. A scenario with a
marker writes its block of BENCHMARKS.md (``--out``) and every case's figures to
``BENCHMARKS_<scenario>.json``; ``--no-write`` prints only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # measure this checkout's fsdp_lite

import bench_harness as bh  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_harness import MIB, Col  # noqa: E402
from bench_systems import (  # noqa: E402
    PRECISIONS,
    SYSTEMS,
    Config,
    build,
    make_batches,
    make_optimizer,
    run_rank,
    train_step,
)  # fmt: skip
from torch import nn  # noqa: E402

import fsdp_lite  # noqa: E402
from fsdp_lite.testing.memory import REGIONS, MemoryRecorder  # noqa: E402
from fsdp_lite.testing.models import GPT, Block  # noqa: E402
from fsdp_lite.testing.spawn import fake_group, run_distributed  # noqa: E402

MODEL_FLAGS = ("layers", "dim", "heads", "seq", "batch", "vocab", "seed")
STEP_FLAGS = ("systems", "precisions", "world_size", "steps", "warmup", "rounds", "threads")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A benchmark: what it is, its defaults over ``Config``'s, the flags it reads, its
    report's marker in BENCHMARKS.md (None: print only), and how it runs."""

    name: str
    doc: str
    defaults: dict[str, Any]
    flags: tuple[str, ...]
    marker: str | None
    run: Callable[[Scenario, Config], tuple[list[str], Any]]
    cols: tuple[Col, ...] = ()
    ref: str | None = None  # the row the "vs" columns compare with


# -- the step-like scenarios: every (system, precision) case in fresh ranks ---------------


def run_cases(sc: Scenario, cfg: Config) -> tuple[list[str], Any]:
    """Every case measured, then reported."""
    results = measure_cases(sc, cfg)
    return report_cases(sc, cfg, results), results


def measure_cases(sc: Scenario, cfg: Config) -> dict[str, dict[str, dict]]:
    """Every (system, precision) case, ``cfg.rounds`` times over, interleaved; per
    precision, per system, its figures (``summarize``)."""
    systems = pick(cfg.systems, SYSTEMS, "--systems")
    precisions = pick(cfg.precisions, PRECISIONS, "--precisions")
    tp_systems = {"fsdp_lite", "fsdp_lite-nocheck", "fsdp2"}
    if cfg.tp > 1 and (cfg.world_size % cfg.tp or set(systems) - tp_systems):
        raise SystemExit(f"--tp must divide --world-size; --systems among {sorted(tp_systems)}")
    rounds: dict[tuple[str, str], list[list[dict]]] = {}
    for rnd in range(cfg.rounds):
        for precision in precisions:
            for system in bh.round_order(systems, rnd):
                print(f"[bench {sc.name}] round {rnd + 1}/{cfg.rounds}: {system} {precision}")
                ranks = run_distributed(
                    run_rank, cfg.world_size, system, precision, cfg,
                    cuda=bh.use_cuda(cfg.world_size), threads=cfg.threads, timeout=cfg.timeout_s,
                )  # fmt: skip
                rounds.setdefault((precision, system), []).append(ranks)
                ms = statistics.median(bh.slowest_per_step(r["step_times_s"] for r in ranks))
                loss0 = ranks[0]["losses"][0]
                print(f"[bench {sc.name}]   {ms * 1e3:.1f} ms/step, loss@0 {loss0:.6f}")
    dp = cfg.world_size // cfg.tp
    results = {p: {s: summarize(rounds[p, s], cfg) for s in systems} for p in precisions}
    psi = bh.count_params(lambda: GPT(cfg.gpt_config()))
    for precision, rows in results.items():
        # The floor's Ψ: the model's, or under TP one tp rank's (its shards over dp)
        local = psi if cfg.tp == 1 else next(iter(rows.values()))["num_params_local"] * dp
        for r in rows.values():
            r["floor"], r["dp"] = zero3_floor(local, precision, dp), dp
            r["comm_vs_floor"] = r["comm_mib"] * MIB / r["floor"] if r["floor"] else None
    return results


def report_cases(sc: Scenario, cfg: Config, results: dict[str, dict[str, dict]]) -> list[str]:
    psi = bh.count_params(lambda: GPT(cfg.gpt_config()))
    lines = [describe(cfg, psi), ""]
    for precision, rows in results.items():
        floor = next(iter(rows.values()))["floor"]
        lines += [f"**{precision}** — ZeRO-3 floor {floor / MIB:.2f} MiB/step/rank", ""]
        lines += [*bh.table(rows, sc.cols, sc.ref), "", loss_check(precision, rows), ""]
        lines += [line for s, r in rows.items() if (line := ops_table(s, precision, r))]
    return lines + library_lines(results, tp=cfg.tp > 1)


def pick(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    """The comma-separated names in ``value``, each one of ``allowed``."""
    picked = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in picked if v not in allowed]
    if bad or not picked:
        raise SystemExit(f"{flag}: unknown {bad or value!r}; choose from {', '.join(allowed)}")
    return picked


def describe(cfg: Config, psi: int) -> str:
    """The model, the job and how figures are taken, in one paragraph."""
    micro = f" x {cfg.micro} micro-batches, each system accumulating at its best" * (cfg.micro > 1)
    tp = f"TP {cfg.tp} (parallelize_gpt) x dp {cfg.world_size // cfg.tp}, " * (cfg.tp > 1)
    backend = "nccl" if bh.use_cuda(cfg.world_size) else "gloo"
    return (
        f"GPT: {cfg.layers} blocks, dim {cfg.dim}, {cfg.heads} heads, seq {cfg.seq}, batch "
        f"{cfg.batch}/rank{micro}, vocab {cfg.vocab}, {'tied' if cfg.tied else 'untied'} "
        f"embedding, {tp}Ψ = {psi:,} parameters"
        f"{', every block activation-checkpointed' * cfg.checkpoint}; W={cfg.world_size} "
        f"({backend}), {cfg.threads} thread(s)/rank, AdamW; median of {cfg.steps} steps "
        f"after {cfg.warmup} first ones in each of {cfg.rounds} interleaved round(s) "
        "(slowest rank per step). CPU ms: CPU time of every thread of the slowest rank, "
        "which other work on the machine barely moves. First step: its wall time (build "
        "excluded), in round 1 and the median of later rounds. RSS: peak before the last "
        "step; between steps: after the last."
    )


def summarize(rounds: list[list[dict[str, Any]]], cfg: Config) -> dict[str, Any]:
    """One case's figures from its rounds of ranks: step times pooled over rounds (the
    slowest rank per step); memory, bytes and losses from round 1 (the largest rank)."""

    def slowest(ranks: list[dict], key: str) -> list[float]:
        return bh.slowest_per_step(r[key] for r in ranks)

    steps = [t for ranks in rounds for t in slowest(ranks, "step_times_s")]
    first = [slowest(ranks, "first_steps_s")[0] for ranks in rounds if ranks[0]["first_steps_s"]]
    ranks = rounds[0]
    median = statistics.median(steps)
    mem = [r.get("memory", {}) for r in ranks]
    return {
        "ms": median * 1e3,
        "cpu_ms": statistics.median(t for rs in rounds for t in slowest(rs, "step_cpu_s")) * 1e3,
        "tokens_s": cfg.world_size // cfg.tp * cfg.batch * cfg.micro * cfg.seq / median,
        "per_round": " / ".join(
            f"{statistics.median(slowest(rs, 'step_times_s')) * 1e3:.0f}" for rs in rounds
        ),
        "first_s": first[0] if first else None,
        "first_later_s": statistics.median(first[1:]) if len(first) > 1 else None,
        "peak_mib": max(m["peak_bytes"] for m in mem) / MIB if mem[0] else None,
        "resident_mib": max(m["resident_bytes"] for m in mem) / MIB if mem[0] else None,
        "rss_mib": max(r["rss_peak_bytes"] for r in ranks) / MIB,
        "rss_between_mib": max(r["rss_between_bytes"] for r in ranks) / MIB,
        "rss_last_mib": max(r["rss_peak_last_step_bytes"] for r in ranks) / MIB,
        "comm_mib": max(sum(c["wire_bytes"] for c in r["comm_per_step"].values()) for r in ranks)
        / MIB,
        "graphs": f"{ranks[0]['graphs_after_warmup']} / {ranks[0]['graphs_at_end']}",
        "loss0": statistics.fmean(r["losses"][0] for r in ranks),
        "loss_last": statistics.fmean(r["losses"][-1] for r in ranks),
        "comm_per_step": ranks[0]["comm_per_step"],
        "library": ranks[0].get("library"),
        "num_params_local": ranks[0]["num_params_local"],
        "root_params_local": ranks[0]["root_params_local"],
        "ops": ranks[0].get("ops"),
        "ops_steps": len(ranks[0]["first_steps_s"]) or 1,
    }


def zero3_floor(num_params: int, precision: str, world: int) -> float:
    """Bytes per rank per step: 2 all-gathers (compute dtype) + 1 reduce-scatter (fp32)."""
    compute = 2 if precision == "bf16" else 4
    return (world - 1) / world * num_params * (2 * compute + 4)


def loss_check(precision: str, rows: dict[str, dict]) -> str:
    """Step-0 losses must agree: same init, same data (bf16 within rounding)."""
    spread = max(r["loss0"] for r in rows.values()) - min(r["loss0"] for r in rows.values())
    tol = 1e-5 if precision == "fp32" else 2e-2
    verdict = "OK" if spread <= tol else "MISMATCH"
    return f"loss@0 spread across systems: {spread:.2e} (tolerance {tol:.0e}) — {verdict}"


def ops_table(system: str, precision: str, r: dict[str, Any]) -> str:
    """``--profile-ops``: where rank 0's step time went, torch.profiler's op table."""
    head = f"{system} {precision}, rank 0's ops over {r['ops_steps']} more steps"
    return f"{head}:\n\n```\n{r['ops']}```\n" if r["ops"] else ""


def library_lines(results: dict[str, dict[str, dict]], tp: bool) -> list[str]:
    """fsdp_lite's own accounting of its last timed step, next to what the benchmark saw;
    under TP its FSDP bytes against their floor on the local parameters."""
    lines = []
    for precision, rows in results.items():
        r = rows.get("fsdp_lite") or {}
        if not (lib := r.get("library")):
            continue
        last, seen = lib["last_step"], r["comm_per_step"]
        ops, seen = (
            ", ".join(f"{op} {c['calls']:.0f}x {c['bytes'] / MIB:.2f} MiB" for op, c in d.items())
            for d in (last["collectives"], seen)
        )
        mem = ", ".join(f"{k} {v / MIB:.2f} MiB" for k, v in lib["memory_stats"].items())
        lines.append(
            f"- {precision}: `fsdp_lite.stats(model)` per step (full-buffer bytes): "
            f"{ops or 'none'} "
            f"(observed at the ProcessGroup: {seen}); exposed communication "
            f"{lib['exposed_s_median'] * 1e3:.1f} ms/step (median), "
            f"{lib['exposed_fraction']:.0%} of step time; full parameters at peak "
            f"{lib['full_bytes_peak'] / MIB:.2f} MiB; {mem}; at most "
            f"{last['unsharded_units_peak']} units unsharded at once"
        )
        if tp:  # TP's collectives are DTensor's, uncounted by fsdp_lite
            lines.append(tp_bytes_line(precision, r, last))
    return ["fsdp_lite's own accounting:", "", *lines, ""] if lines else []


def tp_bytes_line(precision: str, r: dict, last: dict) -> str:
    """fsdp_lite's FSDP collectives against their floor on this rank's local parameters:
    2 gathers (the root's once: it stays gathered for backward) in the compute dtype and 1
    reduce-scatter in fp32, full-buffer bytes."""
    comm = last["collectives"]
    got = sum(comm[op]["bytes"] for op in ("all_gather", "reduce_scatter") if op in comm)
    psi, root = r["num_params_local"] * r["dp"], r["root_params_local"] * r["dp"]
    floor = (2 * psi - root) * (2 if precision == "bf16" else 4) + psi * 4
    return (
        f"- {precision}: fsdp_lite's FSDP collectives {got / MIB:.3f} MiB/step/rank (full "
        f"buffers) vs their floor on the local Ψ = {psi:,} (padded) {floor / MIB:.3f} MiB: "
        f"{got / floor:.3f}x"
    )


def run_compile(sc: Scenario, cfg: Config) -> tuple[list[str], Any]:
    """The step scenario with inductor's cache in a fresh temporary directory: round 1
    compiles from nothing, later rounds from what round 1 left (dynamo traces anew in
    every fresh rank)."""
    if sc.ref not in pick(cfg.systems, SYSTEMS, "--systems"):
        raise SystemExit(f"--systems: the compile scenario measures against {sc.ref}")
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="fsdp_bench_inductor_") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read by the ranks this spawns
        try:
            results = measure_cases(sc, cfg)
        finally:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
            if saved is not None:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
    for rows in results.values():  # compile time: the first step's excess over eager's
        eager = rows[sc.ref]
        for r in rows.values():
            for key in ("first_s", "first_later_s"):
                late = r[key] is not None and eager[key] is not None
                r[key.replace("first", "compile")] = r[key] - eager[key] if late else None
    return report_cases(sc, cfg, results), results


def run_offload(sc: Scenario, cfg: Config) -> tuple[list[str], Any]:
    """The step scenario with large allocations as mmaps, so that freed memory leaves the
    process and RSS is honest."""
    saved = os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # for the ranks
    try:
        lines, results = run_cases(sc, cfg)
    finally:
        if saved == "65536":
            os.environ.pop("MALLOC_MMAP_THRESHOLD_")
    psi = bh.count_params(lambda: GPT(cfg.gpt_config()))
    state = 16 * psi / cfg.world_size
    if bh.use_cuda(cfg.world_size):  # RSS is the host's: model state lives on the GPUs
        return lines, results
    return [
        f"Model state per rank {state / MIB:.0f} MiB (fp32 shard, grad and AdamW's two "
        f"moments); between steps (grads freed by zero_grad) {state * 12 / 16 / MIB:.0f} MiB "
        "of it is resident without offload.",
        "",
        *lines,
    ], results


# -- host: what each system adds per unit, in one process ---------------------------------


def run_host(sc: Scenario, cfg: Config) -> tuple[list[str], Any]:
    """Every system in one process on the fake process group (collectives complete at
    once: host work only), built side by side and stepped in interleaved rounds. Per-unit
    overhead = (system's step - unwrapped step) / units, for the whole step and for
    forward + backward alone (the optimizer step is where flat params save the most)."""
    # One process: the divergence check's mode is process-wide, SSD needs its directory
    allowed = tuple(s for s in SYSTEMS if s not in ("fsdp_lite-nocheck", "fsdp_lite-ssd"))
    systems, results = pick(cfg.systems, allowed, "--systems"), {}
    bh.quiet_fake_rank()
    with fake_group(0, cfg.world_size):
        for precision in pick(cfg.precisions, PRECISIONS, "--precisions"):
            cases = [HostCase(s, precision, cfg) for s in systems]
            for case in cases:
                for _ in range(cfg.warmup):
                    case.step(record=False)
            for rnd in range(cfg.rounds):
                for case in bh.round_order(cases, rnd):
                    for _ in range(cfg.steps):
                        case.step(record=True)
            results[precision] = host_rows(cases, cfg)
    lines = [
        f"Fake process group, W={cfg.world_size}, one process, 1 thread. GPT of {cfg.layers} "
        f"blocks, dim {cfg.dim}, seq {cfg.seq}, batch {cfg.batch}: {cfg.layers + 1} units. "
        f"AdamW. Median over {cfg.rounds} interleaved rounds of {cfg.steps} steps per system.",
        "",
    ]
    for precision, rows in results.items():
        lines += [f"**{precision}**", "", *bh.table(rows, sc.cols, sc.ref), ""]
    return lines, results


class HostCase:
    """One system in one precision: its model, optimizer, and timings of each phase."""

    def __init__(self, system: str, precision: str, cfg: Config) -> None:
        self.system = system
        self.model = build(system, precision, cfg, torch.device("cpu"))
        self.opt = make_optimizer(self.model, cfg)
        self.autocast = system in ("ddp", "unwrapped") and precision == "bf16"
        self.x, self.y = make_batches(cfg, 0, 1, torch.device("cpu"))[0]
        self.step_s: list[float] = []
        self.fwd_bwd_s: list[float] = []

    def step(self, record: bool) -> None:
        watch = bh.Stopwatch()
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            _, loss = self.model(self.x, self.y)
        loss.backward()
        fwd_bwd = watch.wall()
        self.opt.step()
        step = watch.wall()
        if record:
            self.fwd_bwd_s.append(fwd_bwd)
            self.step_s.append(step)


def host_rows(cases: list[HostCase], cfg: Config) -> dict[str, dict[str, float | None]]:
    rows = {
        c.system: {"ms": statistics.median(c.step_s) * 1e3,
                   "fwd_bwd_ms": statistics.median(c.fwd_bwd_s) * 1e3}
        for c in cases
    }  # fmt: skip
    base = rows.get("unwrapped")
    for system, r in rows.items():
        for key in ("ms", "fwd_bwd_ms"):
            wrapped = system != "unwrapped" and base
            r[f"{key}_unit"] = (r[key] - base[key]) / (cfg.layers + 1) * 1e3 if wrapped else None
    return rows


# -- scale: one rank's memory at W=8/64/512 on the fake process group ---------------------

PHASES = ("forward", "backward", "optimizer")
# Origin substring -> category of what is live at the peak, first match wins.
_RULES = (
    ("Optimizer.", "optim"), ("bench::optimizer", "optim"), ("unshard", "gathered"),
    ("pre_backward", "gathered"), ("all_gather", "gathered"), ("pre_forward", "gathered"),
    ("post_backward", "grad RS"), ("finish_backward", "end-of-bwd"),
    ("bench::backward", "bwd compute"), ("bench::forward", "fwd"),
)  # fmt: skip
CATEGORIES = ("resident", "gathered", "bwd compute", "grad RS", "end-of-bwd", "fwd", "optim",
              "other")  # fmt: skip


def run_scale(sc: Scenario, cfg: Config) -> tuple[list[str], Any]:
    """Per (W, system): one rank alone in its process on the fake process group (what rank
    0 of a real job holds), the model built on meta and materialized by the system, bf16
    compute and fp32 reduce, peak tensor memory over the steps after the first."""
    systems = pick(cfg.systems, ("fsdp_lite", "fsdp2"), "--systems")
    fig = model_figures(cfg)
    results = []
    worlds = [int(w) for w in cfg.worlds.split(",") if w.strip()]
    if not worlds or min(worlds) < 1:
        raise SystemExit(f"--worlds: world sizes >= 1, got {cfg.worlds!r}")
    for world in worlds:
        for system in systems:
            with bh.stage(f"[bench scale] W={world} {system}"):
                r = bh.fake_rank(scale_rank, 0, world, system, cfg, timeout_s=cfg.timeout_s)
            results.append(r)
    largest = max(fig["root_params"], fig["block_params"]) * 2
    floor = 16 * fig["num_params"]
    bound = 2 * largest + fig["activation_bytes"]
    ref = {r["world"]: r["peak"] for r in results if r["system"] == "fsdp2"}
    rows = {}
    for r in results:
        at = r["at_peak"]
        peaks = at.get("phase_peaks", {})
        row = {
            "peak": r["peak"] / bh.GIB,
            "vs": bh.ratio(r["peak"], ref.get(r["world"]), digits=3),
            "state": sum(r["model_state"].values()) / bh.GIB,
            "floor": floor / r["world"] / bh.GIB,
            "bound": (floor / r["world"] + bound) / bh.GIB,
            "phase": at.get("phase", "?").removeprefix("bench::"),
            "phases": " / ".join(f"{peaks.get(f'bench::{p}', 0) / bh.GIB:.2f}" for p in PHASES),
            "s": min(r["step_s"][1:] or r["step_s"]),
            **{c: at.get("categories", {}).get(c, 0) / bh.GIB for c in CATEGORIES},
            "lib": "full_bytes_peak {:.2f} GiB, unsharded_units_peak {}".format(
                r["lib"]["full_bytes_peak"] / bh.GIB, r["lib"]["unsharded_units_peak"]
            ) if r["lib"] else "-",
        }  # fmt: skip
        row["rest"], row["vs_bound"] = row["peak"] - row["state"], row["peak"] / row["bound"]
        rows[f"W={r['world']} {r['system']}"] = row
    breakdown = [Col(c, c, "{:.3f}") for c in CATEGORIES]
    breakdown.append(Col("fsdp_lite.stats(model)", "lib", "{}"))
    lines = [
        f"GPT {cfg.layers} blocks, dim {cfg.dim}, {cfg.heads} heads, vocab {cfg.vocab} (tied), "
        f"seq {cfg.seq}, batch {cfg.batch}/rank: Ψ = {fig['num_params']:,}; units: the root "
        f"({fig['root_params']:,} params, {largest / bh.GIB:.3f} GiB in bf16) and "
        f"{cfg.layers} blocks ({fig['block_params']:,} each). AdamW ({cfg.adamw}); peak over "
        f"steps 2..{cfg.steps}. Model state: shards + shard grads + AdamW state after the "
        "last step; rest = peak - model state. Bound = 16Ψ/W + 2 x the largest unit's bf16 "
        f"params + activations ({fig['activation_bytes'] / bh.GIB:.3f} GiB: what autograd "
        "saves in a forward of the unwrapped model, measured on meta). GiB:",
        "",
        *bh.table(rows, sc.cols, None),
        "",
        "Live at the peak, GiB, by where it was allocated: resident, before this step; "
        "gathered, in the gather hooks; bwd compute, by autograd nodes; grad RS, in the "
        "post-backward hooks; fwd, in forward; optim, in the optimizer step:",
        "",
        *bh.table(rows, breakdown, None),
        "",
        "Largest origins at each peak:",
        "",
    ]
    for label, r in zip(rows, results, strict=True):
        at = r["at_peak"]
        top = "; ".join(
            f"{o['origin'].removeprefix('bench::step > ')} {o['bytes'] / bh.GIB:.3f}"
            for o in at.get("origins", [])[:6]
        )
        where = " > ".join(at.get("where", [])[1:]) or "?"
        lines.append(f"- {label}, peak in `{where}`; GiB: {top}")
    return lines, {"model": fig, "results": results}


def scale_rank(rank: int, world: int, system: str, cfg: Config) -> dict[str, Any]:
    """One rank of a ``world``-rank job on the fake process group: build on meta, train
    ``cfg.steps`` steps under the profiler."""
    batch = make_batches(cfg, 0, 1, torch.device("cpu"))[0]
    watch = bh.Stopwatch()
    step_s, lib = [], []
    with MemoryRecorder("cpu", label="bench::step") as rec:
        model = build(system, "bf16", cfg, torch.device("cpu"), meta=True)
        opt = make_optimizer(model, cfg)
        ours = system == "fsdp_lite"
        for _ in range(cfg.steps):
            if ours:
                fsdp_lite.reset_stats(model)
            step = bh.Stopwatch()
            with rec.step():
                train_step(model, opt, batch, autocast=False)
            step_s.append(step.wall())
            if ours:
                lib.append(fsdp_lite.stats(model))
        state = bh.model_state_bytes(model, [opt])
        del model, opt
    counted = lib[1:] or lib
    return {
        "system": system,
        "world": world,
        "peak": rec.peak_bytes,
        "at_peak": rec.live_at_peak(_category, [f"bench::{p}" for p in PHASES],
                                    regions=(*REGIONS, "bench::")),
        "model_state": state,
        "build_s": watch.wall() - sum(step_s),
        "step_s": step_s,
        "lib": {k: max(s[k] for s in counted) for k in ("full_bytes_peak", "unsharded_units_peak")}
        if ours else None,
    }  # fmt: skip


def _category(origin: list[str]) -> str:
    """A coarse bucket (a column of the breakdown table) for an allocation of this step."""
    text = " ".join(origin)
    return next((cat for key, cat in _RULES if key in text), "other")


def model_figures(cfg: Config) -> dict[str, int]:
    """Ψ, a block's and the root's parameters, and the activation bytes autograd saves for
    backward, from a forward of the unwrapped model on meta with its parameters in bf16
    (saved parameters and views of them not counted)."""
    with torch.device("meta"):
        model = GPT(cfg.gpt_config()).to(torch.bfloat16)
    psi = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    params = {id(p) for p in model.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if id(base) not in params:
            saved[id(base)] = base  # kept alive by the graph anyway: ids stay unique
        return t

    x = torch.zeros(cfg.batch, cfg.seq, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    activations = sum(t.numel() * t.element_size() for t in saved.values())
    return {"num_params": psi, "block_params": block, "root_params": psi - cfg.layers * block,
            "activation_bytes": activations}  # fmt: skip


# -- LoRA: backward memory, full fine-tuning vs a frozen base -----------------------------


def run_lora(sc: Scenario, cfg: Config) -> tuple[list[str], Any]:
    """A PEFT Llama (LoRA on q_proj and v_proj, a unit per decoder layer) trained with
    everything trainable (``full``) and with only the adapters (``lora``), modes
    alternating round by round; per mode the median over rounds of the largest rank."""
    if cfg.steps < 2 or cfg.dim % 64:
        raise SystemExit("lora: --steps >= 2 (the first is not measured), --dim a multiple of 64")
    ranks = run_distributed(lora_rank, cfg.world_size, cfg, timeout=cfg.timeout_s)
    rows = {
        mode: {k: max(statistics.median(r[k] for r in rank[mode]) for rank in ranks)
               for k in ranks[0][mode][0]}
        for mode in ("full", "lora")
    }  # fmt: skip
    for r in rows.values():
        r["units_at_once"] = f"{r['units_peak']:.0f} of {r['units']:.0f}"
    full = rows["full"]
    return [
        f"Llama {cfg.layers} layers, hidden {cfg.dim}, vocab {cfg.vocab} "
        f"({full['params'] / 1e6:.2f} M params; largest unit {full['largest_unit_mib']:.1f} MiB "
        f"full), LoRA r={cfg.lora_rank}; W={cfg.world_size} gloo, {cfg.batch}x{cfg.seq} "
        f"tokens per rank; median of {cfg.rounds} rounds, largest rank, backward of steps "
        f"2..{cfg.steps}: peak tensor memory inside backward (profiler allocator events) and "
        "gathered full parameters (`fsdp_lite.stats(model)`).",
        "",
        *bh.table(rows, sc.cols, sc.ref),
    ], rows


def lora_rank(rank: int, world: int, cfg: Config) -> dict[str, list[dict]]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames
    hf = LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.dim, intermediate_size=cfg.dim * 11 // 4,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.dim // 64,
        num_key_value_heads=max(1, cfg.dim // 128), max_position_embeddings=cfg.seq,
        tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    x = make_batches(cfg, rank, 1, torch.device("cpu"))[0][0]
    out: dict[str, list[dict]] = {"full": [], "lora": []}
    for _ in range(cfg.rounds):
        for mode in out:  # interleaved: drift in machine load hits both modes alike
            full_peaks, unit_peaks = [], []
            with MemoryRecorder("cpu", label="bench::backward") as rec:
                torch.manual_seed(cfg.seed)
                lora = LoraConfig(r=cfg.lora_rank, target_modules=["q_proj", "v_proj"])
                model = get_peft_model(LlamaForCausalLM(hf), lora)
                for p in model.parameters() if mode == "full" else ():
                    p.requires_grad_(True)
                trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
                total = sum(p.numel() for p in model.parameters())
                policy = fsdp_lite.wrap.by_type(*fsdp_lite.wrap.transformer_layers(model))
                model = fsdp_lite.FSDPModule(  # a CPU benchmark, on a GPU machine too
                    model, auto_wrap_policy=policy, device=torch.device("cpu")
                )
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
                for _ in range(cfg.steps):
                    loss = model(input_ids=x, labels=x, use_cache=False).loss
                    fsdp_lite.reset_stats(model)
                    with rec.step():
                        loss.backward()
                    s = fsdp_lite.stats(model)
                    full_peaks.append(s["full_bytes_peak"])
                    unit_peaks.append(s["unsharded_units_peak"])
                    if s["full_bytes_now"]:
                        raise RuntimeError(f"{mode}: {s['full_bytes_now']} full bytes left")
                    opt.step()
                    opt.zero_grad()
                largest = model.memory_stats()["largest_unit_full_bytes"]
                units = sum(isinstance(m, fsdp_lite.FSDPModule) for m in model.modules())
                del model, opt, loss
            out[mode].append({
                "peak_mib": rec.peak_bytes / MIB, "full_mib": max(full_peaks[1:]) / MIB,
                "units_peak": max(unit_peaks[1:]), "units": units, "trainable": trainable / 1e6,
                "params": total, "largest_unit_mib": largest / MIB,
            })  # fmt: skip
    return out


# -- Muon: whole-parameter shards against FSDP2 + a gathering Muon ------------------------

MUON_CASES = ("default + AdamW", "whole + AdamW", "whole + Muon", "FSDP2 + Muon (gather)")
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)


def newton_schulz(grad: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Orthogonalize a 2-D matrix like ``torch.optim.Muon``: bf16, divided by its Frobenius
    norm, tall matrices transposed, ``steps`` quintic iterations."""
    a, b, c = NS_COEFFICIENTS
    tall = grad.size(0) > grad.size(1)
    x = grad.bfloat16().T if tall else grad.bfloat16()
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class GatherMuon:
    """Muon over FSDP2 parameters (DTensors sharded on dim 0) as its users write it:
    momentum on the local shard, the Nesterov update all-gathered to the full matrix (rows
    padded to FSDP2's chunk), orthogonalized on every rank, this rank's rows applied with
    decoupled weight decay and ``torch.optim.Muon``'s default lr scaling."""

    def __init__(self, params: list[nn.Parameter], lr: float, wd: float = 0.1) -> None:
        self.params, self.lr, self.wd, self.momentum = params, lr, wd, 0.95
        self.bufs: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def step(self) -> None:
        for p in (p for p in self.params if p.grad is not None):
            group = p.device_mesh.get_group()
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            rows, cols = p.shape
            chunk = -(-rows // world)  # FSDP2's dim-0 shards: ceil(rows / W), the last short
            grad, local = p.grad.to_local(), p.to_local()
            buf = self.bufs.setdefault(id(p), torch.zeros_like(grad))
            buf.lerp_(grad, 1 - self.momentum)
            update = grad.lerp(buf, self.momentum)  # Nesterov
            padded = update.new_zeros(chunk, cols)
            padded[: update.shape[0]] = update
            full = update.new_empty(world * chunk, cols)
            dist.all_gather_into_tensor(full, padded, group=group)
            start = min(rank * chunk, rows)
            mine = newton_schulz(full[:rows])[start : start + local.shape[0]]
            local.mul_(1 - self.lr * self.wd)
            local.add_(mine, alpha=-self.lr * max(1, rows / cols) ** 0.5)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def muon_case(case: str, cfg: Config) -> tuple[nn.Module, list[Any]]:
    """The seeded GPT wrapped for ``case`` and its optimizers: Muon on the blocks' 2-D
    matrices, AdamW on the rest (none over an empty list: under whole params a rank may own
    no matrix, or nothing else)."""
    torch.manual_seed(cfg.seed)
    model, world = GPT(cfg.gpt_config()), dist.get_world_size()
    if case == MUON_CASES[3]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))  # the batches are on the CPU, gloo
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    else:  # a group per model: whole params balance owners over what a group wraps
        model = fsdp_lite.FSDPModule(
            model, process_group=dist.new_group(list(range(world))),
            auto_wrap_policy=fsdp_lite.wrap.by_type(Block), device=torch.device("cpu"),
            optimizer_params="flat" if case == MUON_CASES[0] else "whole",
        )  # fmt: skip
    named = list(model.named_parameters())
    muon = "Muon" in case
    mats = [p for n, p in named if muon and p.ndim == 2 and "blocks." in n]
    rest = [p for n, p in named if not (muon and p.ndim == 2 and "blocks." in n)]
    opts: list[Any] = [torch.optim.AdamW(rest, lr=cfg.lr)] if rest else []
    if mats:
        gather = case == MUON_CASES[3]
        opts.append((GatherMuon if gather else torch.optim.Muon)(mats, lr=cfg.muon_lr))
    return model, opts


def muon_rank(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    """One rank (gloo or fake): every case built, ``cfg.rounds`` interleaved rounds of the
    same ``warmup + steps`` batches; step and optimizer times, bytes per step in all and
    inside the optimizer step."""
    batches = make_batches(cfg, rank, cfg.warmup + cfg.steps, torch.device("cpu"))
    built = {case: muon_case(case, cfg) for case in MUON_CASES}
    out = {c: {"step_s": [], "opt_s": [], "losses": []} for c in MUON_CASES}
    counts = {c: (bh.new_counts(), bh.new_counts()) for c in MUON_CASES}
    for _ in range(cfg.rounds):
        for case, (model, opts) in built.items():
            step_s, opt_s = [], []
            for i, (x, y) in enumerate(batches):
                dist.barrier()  # ranks start each step together: the slowest rank is the step
                timed, (comm, opt_comm) = i >= cfg.warmup, counts[case]
                with bh.count_collectives(comm if timed else None):
                    watch = bh.Stopwatch()
                    for opt in opts:
                        opt.zero_grad(set_to_none=True)
                    _, loss = model(x, y)
                    loss.backward()
                    fwd_bwd = watch.wall()
                    with bh.count_collectives(opt_comm if timed else None):
                        for opt in opts:
                            opt.step()
                    step = watch.wall()
                if timed:
                    step_s.append(step)
                    opt_s.append(step - fwd_bwd)
                out[case]["losses"].append(loss.item())
            out[case]["step_s"].append(step_s)
            out[case]["opt_s"].append(opt_s)
    for case, (comm, opt_comm) in counts.items():
        for key, c in (("comm", comm), ("opt_comm", opt_comm)):
            per = bh.per_step(c, cfg.rounds * cfg.steps)
            out[case][key] = sum(k["bytes"] for k in per.values())
    return out


def muon_layout(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    """Rank 0 of ``world`` on the fake process group: all-gather + reduce-scatter bytes of
    one step of the default layout and of whole params (fsdp_lite's accounting), the bytes
    each rank owns under whole params, and what gathering and reduce-scattering every flat
    param padded to W x its largest per-rank piece would move instead."""
    from fsdp_lite.core.tree import units_of

    x, y = make_batches(cfg, rank, 1, torch.device("cpu"))[0]
    ops = ("all_gather", "reduce_scatter")
    result: dict[str, Any] = {}
    for case in MUON_CASES[:2]:
        model, opts = muon_case(case, cfg)
        for _ in range(2):  # the first step also runs the divergence check in lockstep
            fsdp_lite.reset_stats(model)
            model(x, y)[1].backward()
        stats, owned, padded = fsdp_lite.stats(model), [0] * world, 0.0
        for u in units_of(model):
            moved = sum(stats["units"].get(u.name, {}).get(op, {}).get("bytes", 0) for op in ops)
            full = pad = 0
            for f in u.flat_params:
                size = f.shard.element_size()
                pieces = list(zip(f.bounds, f.bounds[1:], strict=False))
                for r, (a, b) in enumerate(pieces):
                    owned[r] += (b - a) * size
                full += f.bounds[-1] * size
                pad += world * max(b - a for a, b in pieces) * size
            padded += moved * pad / full if full else 0.0
        result[case] = {
            "bytes": sum(stats["collectives"].get(op, {}).get("bytes", 0) for op in ops),
            "owned": owned,
            "padded": padded,
        }
    d, w = result[MUON_CASES[0]], result[MUON_CASES[1]]
    return {
        "default AG+RS MiB/step": d["bytes"] / MIB, "whole AG+RS MiB/step": w["bytes"] / MIB,
        "whole/default": w["bytes"] / d["bytes"], "owned MiB/rank max": max(w["owned"]) / MIB,
        "owned max/mean": max(w["owned"]) / statistics.fmean(w["owned"]),
        "padded to max piece MiB/step": w["padded"] / MIB,
        "padded/default": w["padded"] / d["bytes"],
    }  # fmt: skip


def muon_rows(ranks: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per case over its ranks: slowest rank per step, median per round, median of rounds."""
    rows = {}
    for case in MUON_CASES:
        rounds = range(len(ranks[0][case]["step_s"]))
        opt = [bh.median_of_rounds(r[case]["opt_s"]) for r in ranks]
        rows[case] = {
            "comm": max(r[case]["comm"] for r in ranks) / MIB,
            "opt_comm": max(r[case]["opt_comm"] for r in ranks) / MIB,
            "ms": bh.median_of_rounds(
                bh.slowest_per_step(r[case]["step_s"][k] for r in ranks) for k in rounds
            ) * 1e3,
            "opt_ms": max(opt) * 1e3,
            "opt_balance": max(opt) / statistics.fmean(opt) if statistics.fmean(opt) else None,
            "loss": "{:.6f} -> {:.6f}".format(
                *(statistics.fmean(r[case]["losses"][i] for r in ranks) for i in (0, -1))
            ),
        }  # fmt: skip
    return rows


def run_muon(sc: Scenario, cfg: Config) -> tuple[list[str], Any]:
    """The four cases at W=``world_size`` on real gloo ranks (losses comparable) and at
    W=``fake_world`` on the fake process group, one process per rank in turn (bytes, host
    and optimizer time; losses meaningless: fsdp_lite's uneven gathers leave other ranks'
    rows unwritten); then the layout table at W=2..``max_layout_world``."""
    if min(cfg.world_size, cfg.fake_world, cfg.max_layout_world) < 2:
        raise SystemExit("muon: --world-size, --fake-world and --max-layout-world >= 2")
    psi = bh.count_params(lambda: GPT(cfg.gpt_config()))
    with bh.stage(f"[bench muon] W={cfg.world_size} gloo"):
        gloo = run_distributed(muon_rank, cfg.world_size, cfg, timeout=cfg.timeout_s)
    with bh.stage(f"[bench muon] W={cfg.fake_world} fake PG"):
        fake = [bh.fake_rank(muon_rank, r, cfg.fake_world, cfg, timeout_s=cfg.timeout_s)
                for r in range(cfg.fake_world)]  # fmt: skip
    with bh.stage("[bench muon] layouts"):
        layouts = {f"W={w}": bh.fake_rank(muon_layout, 0, w, cfg, timeout_s=cfg.timeout_s)
                   for w in range(2, cfg.max_layout_world + 1)}  # fmt: skip
    layout_cols = [Col(k, k, "{:.2f}" if "MiB" in k else "{:.2f}x") for k in layouts["W=2"]]
    results = {"gloo": muon_rows(gloo), "fake": muon_rows(fake), "layouts": layouts}
    return [
        f"GPT {cfg.layers} blocks, dim {cfg.dim}, {cfg.heads} heads, vocab {cfg.vocab}, "
        f"untied, seq {cfg.seq}, {cfg.batch} sequences/rank, fp32, Ψ = {psi:,}; a unit per "
        f"Block plus the root. Muon lr {cfg.muon_lr} (torch defaults otherwise), AdamW lr "
        f"{cfg.lr}. Median over {cfg.rounds} interleaved rounds of the per-round median of "
        f"{cfg.steps} steps after {cfg.warmup} warm-up; ms/step: slowest rank per step. "
        "Communication: full-buffer bytes of every ProcessGroup collective per step and "
        "rank (max over ranks); 'in optimizer': issued inside the optimizer step.",
        "",
        f"**W={cfg.world_size}, gloo** (real ranks, 1 thread each)",
        "",
        *bh.table(results["gloo"], sc.cols, sc.ref),
        "",
        f"**W={cfg.fake_world}, fake process group** (no data moves, losses meaningless)",
        "",
        *bh.table(results["fake"], sc.cols[:-1], sc.ref),
        "",
        "**Whole-parameter layout vs the default** (fake process group, rank 0; padded: "
        "every flat param moved as W x its largest per-rank piece)",
        "",
        *bh.table(layouts, layout_cols, None),
    ], results


# -- the scenarios ------------------------------------------------------------------------
# fmt: off

STEP_COLS = (
    Col("ms/step", "ms", vs=True), Col("CPU ms/step", "cpu_ms", "{:.0f}", vs=True),
    Col("tokens/s", "tokens_s", "{:,.0f}"), Col("peak MiB", "peak_mib", vs=True),
    Col("resident MiB", "resident_mib"), Col("RSS MiB", "rss_mib", "{:.0f}", vs=True),
    Col("comm MiB/step", "comm_mib", "{:.2f}", vs=True),
    Col("vs floor", "comm_vs_floor", "{:.2f}x"), Col("loss@0", "loss0", "{:.6f}"),
    Col("loss@last", "loss_last", "{:.4f}"),
)  # fmt: skip
STEP_DEFAULTS = {"profile_steps": 3}
SCENARIOS = {
    sc.name: sc
    for sc in (
        Scenario(
            "step", "the training step at W=2 against FSDP2, FSDP1 and DDP",
            STEP_DEFAULTS, STEP_FLAGS + MODEL_FLAGS + ("checkpoint",
            "profile_steps", "profile_ops"), "step", run_cases, STEP_COLS, "fsdp2",
        ),
        Scenario(
            "accum", "gradient accumulation, 8 micro-batches a step, against FSDP2 at its best",
            {"micro": 8, "systems": "fsdp_lite,fsdp2", "batch": 1, "seq": 128, "steps": 10,
             "rounds": 3}, STEP_FLAGS + MODEL_FLAGS + ("micro",), "accum", run_cases,
            STEP_COLS, "fsdp2",
        ),
        Scenario(
            "2d", "fsdp_lite + TP against FSDP2 + TP (tp 2 x dp 2, W=4)",
            {"tp": 2, "world_size": 4, "systems": "fsdp_lite,fsdp2", "layers": 4, "dim": 128,
             "seq": 128, "batch": 2, "steps": 10, "rounds": 5},
            STEP_FLAGS + MODEL_FLAGS + ("tp",), "2d", run_cases, STEP_COLS, "fsdp2",
        ),
        Scenario(
            "compile", "fsdp_lite with compiled blocks (inductor) against eager",
            {"systems": "fsdp_lite,fsdp_lite-compiled", "rounds": 3, "steps": 10,
             "warmup": 2, "profile_steps": 0}, STEP_FLAGS + MODEL_FLAGS, "compile",
            run_compile,
            (Col("ms/step", "ms", vs=True), Col("CPU ms/step", "cpu_ms", "{:.0f}", vs=True),
             Col("tokens/s", "tokens_s", "{:,.0f}"), Col("ms/step per round", "per_round", "{}"),
             Col("first step s", "first_s"), Col("later rounds", "first_later_s"),
             Col("compile s", "compile_s"), Col("later rounds", "compile_later_s"),
             Col("graphs after first steps / at end", "graphs", "{}"),
             Col("loss@0", "loss0", "{:.6f}"), Col("loss@last", "loss_last", "{:.6f}")),
            "fsdp_lite",
        ),
        Scenario(
            "offload", "resident memory and step time with CPU and SSD offload",
            {"systems": "fsdp_lite,fsdp_lite-cpu,fsdp_lite-ssd", "precisions": "fp32",
             "layers": 8, "dim": 1024, "heads": 8, "vocab": 8192, "seq": 64, "batch": 1,
             "steps": 3, "warmup": 2, "profile_steps": 0, "timeout_s": 1800.0},
            STEP_FLAGS + MODEL_FLAGS, "offload", run_offload,
            (Col("RSS between steps MiB", "rss_between_mib", "{:.0f}", vs=True),
             Col("peak RSS in the last step MiB", "rss_last_mib", "{:.0f}", vs=True),
             Col("ms/step", "ms", "{:.0f}", vs=True)),
            "fsdp_lite",
        ),
        Scenario(
            "host", "host overhead per unit, 64 tiny blocks, fake process group W=8",
            {"systems": "unwrapped,fsdp_lite,fsdp_lite-pieces,fsdp_lite-whole,fsdp2,fsdp1",
             "world_size": 8, "layers": 64, "dim": 32, "heads": 2, "seq": 16, "batch": 2,
             "vocab": 128, "rounds": 5, "steps": 10},
            ("systems", "precisions", "world_size", "layers", "dim", "steps", "warmup",
             "rounds"), "host", run_host,
            (Col("ms/step", "ms"), Col("µs/unit over unwrapped", "ms_unit", "{:.0f}", vs=True),
             Col("fwd+bwd ms", "fwd_bwd_ms"),
             Col("µs/unit fwd+bwd", "fwd_bwd_ms_unit", "{:.0f}", vs=True)),
            "fsdp2",
        ),
        Scenario(
            "scale", "per-rank peak memory of a 1.3B GPT at W=8/64/512, fake process group",
            {"systems": "fsdp_lite,fsdp2", "layers": 24, "dim": 2048, "heads": 16,
             "vocab": 50304, "seq": 128, "batch": 1, "steps": 3, "lr": 1e-4,
             "adamw": "foreach"},
            ("systems", "worlds", "layers", "dim", "heads", "vocab", "seq", "batch", "steps",
             "adamw"), "scale", run_scale,
            (Col("peak", "peak", "{:.2f}"), Col("vs FSDP2", "vs", "{}"),
             Col("model state", "state", "{:.2f}"), Col("16Ψ/W", "floor", "{:.2f}"),
             Col("rest", "rest", "{:.2f}"), Col("bound", "bound", "{:.2f}"),
             Col("peak / bound", "vs_bound", "{:.2f}"), Col("peak in", "phase", "{}"),
             Col("fwd / bwd / optim peaks", "phases", "{}"), Col("s/step", "s")),
        ),
        Scenario(
            "lora", "backward memory: full fine-tuning vs a frozen base with LoRA (PEFT Llama)",
            {"layers": 8, "dim": 256, "vocab": 1024, "seq": 64, "batch": 2, "steps": 3,
             "rounds": 3, "timeout_s": 900.0},
            ("world_size", "layers", "dim", "vocab", "seq", "batch", "lora_rank", "steps",
             "rounds"), None, run_lora,
            (Col("trainable M", "trainable", "{:.2f}", vs=True),
             Col("peak MiB in backward", "peak_mib", vs=True),
             Col("gathered full params, peak MiB", "full_mib", vs=True),
             Col("units gathered at once", "units_at_once", "{}")),
            "full",
        ),
        Scenario(
            "muon", "Muon on whole-parameter shards against FSDP2 + a gathering Muon",
            {"layers": 8, "dim": 128, "vocab": 512, "seq": 64, "batch": 2, "tied": False,
             "steps": 10, "warmup": 2, "rounds": 5},
            ("world_size", "fake_world", "max_layout_world", "steps", "warmup", "rounds",
             *MODEL_FLAGS, "muon_lr"), None, run_muon,
            (Col("comm MiB/step", "comm", "{:.2f}", vs=True),
             Col("in optimizer MiB", "opt_comm", "{:.2f}"), Col("ms/step", "ms", vs=True),
             Col("optimizer ms (max rank)", "opt_ms", "{:.2f}", vs=True),
             Col("optimizer max/mean", "opt_balance", "{:.2f}"),
             Col("loss first -> last", "loss", "{}")),
            MUON_CASES[0],
        ),
    )
}
# fmt: on


def parse_args(argv: list[str] | None) -> tuple[Scenario, Config, argparse.Namespace]:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    subs = p.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    fields = {f.name: f for f in dataclasses.fields(Config)}
    for sc in SCENARIOS.values():
        sub = subs.add_parser(sc.name, help=sc.doc, description=sc.doc)
        defaults = Config(**sc.defaults)
        for name in sc.flags:
            value, flag = getattr(defaults, name), f"--{name.replace('_', '-')}"
            if isinstance(value, bool):
                sub.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
            else:
                sub.add_argument(flag, type=type(value), default=value, help=f"default {value}")
        sub.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md", help="the report")
        sub.add_argument("--no-write", action="store_true", help="print the report only")
    args = p.parse_args(argv)
    sc = SCENARIOS[args.scenario]
    cfg = Config(**{**sc.defaults, **{k: v for k, v in vars(args).items() if k in fields}})
    if cfg.threads == 0:  # the ranks share the cores
        cfg = dataclasses.replace(cfg, threads=max(1, (os.cpu_count() or 1) // cfg.world_size))
    if min(cfg.steps, cfg.rounds, cfg.world_size) < 1 or cfg.warmup < 0:
        p.error("need --steps, --rounds, --world-size >= 1 and --warmup >= 0")
    return sc, cfg, args


def main(argv: list[str] | None = None) -> None:
    sc, cfg, args = parse_args(argv)
    info, watch = bh.machine(), bh.Stopwatch()
    lines, results = sc.run(sc, cfg)
    lines = bh.provenance(info, watch.wall()) + lines
    payload = {"info": info, "config": dataclasses.asdict(cfg), "results": results}
    bh.publish(lines, payload, sc.marker, args.out, write=not args.no_write)


if __name__ == "__main__":
    main()
