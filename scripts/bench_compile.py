"""Compiled vs eager blocks under fsdp_lite: tokens/s of the benchmark GPT, W ranks (gloo).

    .venv/bin/python scripts/bench_compile.py [--rounds 3] [--steps 10] [--warmup 2]
        [--precisions fp32,bf16] [--no-write]

The GPT of ``scripts/bench.py`` (``bench_systems.BenchConfig``: 4 blocks, dim 256, seq 256,
batch 4 per rank), one unit per block plus the root, AdamW. ``compiled``:
``fsdp_lite.compile_blocks(model, Block)`` (inductor, fullgraph) before wrapping; ``eager``:
the same without it. Every (round, precision, mode) case runs in freshly spawned ranks, the
modes in alternating order round by round. A case times ``--warmup`` first steps (the
compiled mode's first one compiles forward and backward) apart from ``--steps`` timed steps
(the slowest rank per step); ms/step and tokens/s are medians over the timed steps of every
round. Compile time is the first step's excess over eager's first step: in round 1 with an
empty inductor cache (this run's own temporary cache directory), in later rounds with the
cache filled by round 1 (dynamo still traces anew in every fresh rank). The number of
graphs dynamo compiled is read after the warm-up and after the timed steps: the same
(no recompiles while timing).

Writes the block between the bench-compile markers of BENCHMARKS.md and the raw results
to BENCHMARKS_compile.json (``--no-write``: print only).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # measure this checkout's fsdp_lite

import bench_measure as bm  # noqa: E402
from bench_systems import BenchConfig, make_batches, train_step  # noqa: E402

import fsdp_lite  # noqa: E402
from fsdp_lite.testing.models import GPT, Block  # noqa: E402
from fsdp_lite.testing.spawn import run_distributed  # noqa: E402

MARKERS = "<!-- bench-compile:begin -->", "<!-- bench-compile:end -->"
MODES = ("eager", "compiled")
PRECISIONS = ("fp32", "bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bm.make_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every case")
    p.add_argument("--steps", type=int, default=10, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=2, help="first steps, timed apart (>= 1)")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated: fp32,bf16")
    p.add_argument("--world-size", type=int, default=2)
    bm.add_config_args(
        p, BenchConfig(), ("layers", "dim", "seq", "batch"), helps={"batch": "sequences per rank"}
    )
    bm.add_output_args(p, ROOT / "BENCHMARKS_compile.json")
    args = p.parse_args(argv)
    args.precisions = bm.pick(args.precisions, PRECISIONS, "--precisions")
    if min(args.rounds, args.steps, args.warmup, args.world_size) < 1:
        p.error("need --rounds, --steps, --warmup and --world-size >= 1")
    return args


# -- one rank ------------------------------------------------------------------------------


def build(cfg: BenchConfig, precision: str, mode: str) -> fsdp_lite.FSDPModule:
    """The GPT (same seed in every case), its blocks compiled in ``compiled`` mode, then one
    unit per block plus the root."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.gpt_config())
    if mode == "compiled":
        fsdp_lite.compile_blocks(model, Block)
    mp_policy = fsdp_lite.MixedPrecision(torch.bfloat16, torch.float32)
    return fsdp_lite.FSDPModule(
        model,
        auto_wrap_policy=fsdp_lite.wrap.by_type(Block),
        mixed_precision=mp_policy if precision == "bf16" else None,
        device=torch.device("cpu"),
    )


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def run_rank(rank: int, world: int, cfg: BenchConfig, precision: str, mode: str) -> dict[str, Any]:
    """One rank of a case: first steps, then timed steps; step times and losses."""
    batches = make_batches(cfg, rank, cfg.warmup + cfg.steps, torch.device("cpu"))
    model = build(cfg, precision, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    first, times, cpu, losses = [], [], [], []
    for i in range(cfg.warmup + cfg.steps):
        dist.barrier()  # every rank starts the step together: the slowest rank is the step
        watch = bm.Stopwatch()
        loss = train_step(model, opt, batches[i], autocast=False)
        (first if i < cfg.warmup else times).append(watch.wall())
        if i >= cfg.warmup:
            cpu.append(watch.cpu())
        losses.append(loss.item())
        if i == cfg.warmup - 1:
            graphs_after_warmup = _graphs()
    return {
        "first_steps_s": first,
        "step_times_s": times,
        "step_cpu_s": cpu,
        "losses": losses,
        "graphs_after_warmup": graphs_after_warmup,
        "graphs_at_end": _graphs(),
    }


# -- the driver ----------------------------------------------------------------------------


def run_case(cfg: BenchConfig, precision: str, mode: str, world: int) -> list[dict[str, Any]]:
    """``world`` fresh ranks (gloo) for one case; each rank's result."""
    return run_distributed(
        run_rank, world, cfg, precision, mode, threads=cfg.threads, timeout=cfg.timeout_s
    )


def slowest(ranks: list[dict[str, Any]], key: str) -> list[float]:
    """Per step, the slowest rank's ``key`` time."""
    return bm.slowest_per_step(r[key] for r in ranks)


def run_all(args: argparse.Namespace, cfg: BenchConfig) -> dict[str, dict[str, list]]:
    """results[precision][mode] = one entry per round (each rank's result, and the wall
    time of the whole case). Modes alternate order round by round."""
    results: dict[str, dict[str, list]] = {p: {m: [] for m in MODES} for p in args.precisions}
    for rnd in range(args.rounds):
        for precision in args.precisions:
            for mode in bm.round_order(MODES, rnd):
                print(f"[bench-compile] round {rnd + 1}/{args.rounds}: {precision} {mode} ...")
                watch = bm.Stopwatch()
                ranks = run_case(cfg, precision, mode, args.world_size)
                results[precision][mode].append({"ranks": ranks, "case_wall_s": watch.wall()})
                ms = statistics.median(slowest(ranks, "step_times_s")) * 1e3
                first = slowest(ranks, "first_steps_s")[0]
                print(f"[bench-compile]   {ms:.1f} ms/step, first step {first:.1f} s", flush=True)
    return results


def summarize(rounds: list[dict], cfg: BenchConfig, world: int) -> dict[str, Any]:
    """Medians over every timed step of every round; first steps of round 1 and later."""
    steps = [t for r in rounds for t in slowest(r["ranks"], "step_times_s")]
    cpu = [t for r in rounds for t in slowest(r["ranks"], "step_cpu_s")]
    per_round = [statistics.median(slowest(r["ranks"], "step_times_s")) for r in rounds]
    first = [slowest(r["ranks"], "first_steps_s")[0] for r in rounds]
    ranks0 = [r["ranks"][0] for r in rounds]
    median = statistics.median(steps)
    return {
        "median_step_s": median,
        "median_cpu_s": statistics.median(cpu),
        "tokens_per_s": world * cfg.batch * cfg.seq / median,
        "per_round_ms": [round(x * 1e3, 1) for x in per_round],
        "first_step_s_round1": first[0],
        "first_step_s_later": statistics.median(first[1:]) if len(first) > 1 else None,
        "graphs": sorted({(r["graphs_after_warmup"], r["graphs_at_end"]) for r in ranks0}),
        "loss0": ranks0[0]["losses"][0],
        "loss_last": ranks0[0]["losses"][-1],
        "loss_last_spread": max(r["losses"][-1] for r in ranks0)
        - min(r["losses"][-1] for r in ranks0),
    }


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(precision: str, by_mode: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows of one precision: each mode, its speed against eager (wall time: the
    median of the round-by-round ratios; CPU time: of the pooled medians), its first step."""
    eager = by_mode["eager"]
    rows = []
    for mode, r in by_mode.items():
        keys = ("first_step_s_round1", "first_step_s_later")
        compile_s = [
            r[k] - eager[k] if mode != "eager" and r[k] is not None else None for k in keys
        ]
        pairs = zip(eager["per_round_ms"], r["per_round_ms"], strict=True)
        speedup = statistics.median(e / c for e, c in pairs)
        cells = [
            mode,
            f"{r['median_step_s'] * 1e3:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{speedup:.2f}x",
            f"{r['median_cpu_s'] * 1e3:.0f}",
            bm.ratio(eager["median_cpu_s"], r["median_cpu_s"]),
            " / ".join(f"{x:.0f}" for x in r["per_round_ms"]),
            f"{_fmt_s(r['first_step_s_round1'])} / {_fmt_s(r['first_step_s_later'])}",
            f"{_fmt_s(compile_s[0])} / {_fmt_s(compile_s[1])}",
            ", ".join(f"{a} / {b}" for a, b in r["graphs"]),
            f"{r['loss0']:.6f}",
            f"{r['loss_last']:.6f}",
        ]
        rows.append(cells)
    columns = (
        "blocks", "ms/step", "tokens/s", "vs eager", "CPU ms/step", "vs eager",
        "ms/step per round", "first step s, round 1 / later", "compile s, round 1 / later",
        "graphs after first steps / at end", "loss@0", "loss@last",
    )  # fmt: skip
    return [f"**{precision}**", "", *bm.md_table(columns, rows, "lrrrrrlrrrrr")]


def report(args: argparse.Namespace, cfg: BenchConfig, summary: dict, info: dict) -> str:
    """The markdown block between the bench-compile markers of BENCHMARKS.md."""
    m = info["machine"]
    lines = [
        MARKERS[0],
        "## torch.compile: compiled blocks vs eager",
        "",
        f"{bm.run_line(info['date'], m)}, load average at start {m['load_avg']}, at end "
        f"{info['load_avg_end']}; the whole run took {info['wall_s']:.0f} s.",
        "",
        f"    {info['command']}",
        "",
        f"GPT: {cfg.layers} blocks, dim {cfg.dim}, {cfg.heads} heads, seq {cfg.seq}, batch "
        f"{cfg.batch}/rank, vocab {cfg.vocab}, tied embedding; fsdp_lite, one unit per block "
        f"plus the root; W={args.world_size} (gloo), {cfg.threads} thread/rank, AdamW. "
        "`compiled`: `fsdp_lite.compile_blocks(model, Block)` before wrapping (inductor, "
        f"fullgraph). Median of {cfg.steps} timed steps (slowest rank per step) after "
        f"{cfg.warmup} first steps, pooled over {args.rounds} interleaved round(s), each case "
        "in fresh ranks; vs eager (wall): the median of the per-round ratios, which pairs "
        "cases run close in time; CPU ms/step: CPU time of every thread of the slowest rank, "
        "which other work on the machine barely moves. First step: wall time of step 1 (build "
        "excluded); compile s: the compiled first step minus eager's, round 1 with an empty "
        "inductor cache, later rounds from the cache round 1 filled (dynamo traces again in "
        "each fresh rank). Graphs: dynamo's count after the first steps and after the timed "
        "ones (equal: no recompiles).",
        "",
    ]
    for precision, by_mode in summary.items():
        lines += table(precision, by_mode)
        d0 = abs(by_mode["compiled"]["loss0"] - by_mode["eager"]["loss0"])
        dl = abs(by_mode["compiled"]["loss_last"] - by_mode["eager"]["loss_last"])
        lines += ["", f"compiled vs eager loss: |Δ| {d0:.2e} at step 0, {dl:.2e} at the last", ""]
    lines.append(MARKERS[1])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = bm.config_from_args(BenchConfig, args)  # one thread per rank: the default
    watch = bm.Stopwatch()
    info = bm.run_info("scripts/bench_compile.py", argv)
    info["config"] = dataclasses.asdict(cfg)
    with tempfile.TemporaryDirectory(prefix="fsdp_bench_inductor_") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # round 1 compiles from nothing
        results = run_all(args, cfg)
    info["load_avg_end"] = bm.load_avg()
    info["wall_s"] = watch.wall()
    summary = {
        p: {m: summarize(results[p][m], cfg, args.world_size) for m in MODES} for p in results
    }
    block = report(args, cfg, summary, info)
    payload = {"info": info, "summary": summary, "raw": results}
    bm.publish(block, payload, args, MARKERS, "bench-compile")


if __name__ == "__main__":
    main()
