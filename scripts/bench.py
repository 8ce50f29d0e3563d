"""Side-by-side benchmark: fsdp_lite vs PyTorch FSDP2, FSDP1 and DDP on one GPT.

    .venv/bin/python scripts/bench.py [--systems fsdp_lite,fsdp2,fsdp1,ddp]
        [--precisions fp32,bf16] [--steps 20 --warmup 3] [--world-size 2] [--threads 1]
    make bench ARGS='--steps 10'
    make bench-accum      # --micro 8: gradient accumulation, fsdp_lite against FSDP2
    make bench-2d         # --tp 2 --world-size 4: fsdp_lite + TP against FSDP2 + TP

Each (system, precision) runs in freshly spawned ranks (gloo on CPU; NCCL when every rank
has a GPU) on the same model (same seed, built before wrapping) and the same data. Per
case it reports the median step time (max over ranks per step), tokens/s, peak tensor
memory per rank (torch.profiler allocator events, in a separate short profiled pass),
peak RSS, and communication per step per rank observed at the ProcessGroup collectives,
each next to FSDP2's figure and the ZeRO-3 floor. Writes JSON and a table in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # measure this checkout's fsdp_lite

import bench_measure as bm  # noqa: E402
from bench_systems import PRECISIONS, SYSTEMS, BenchConfig, rank_main  # noqa: E402

from fsdp_lite.testing.models import GPT  # noqa: E402
from fsdp_lite.testing.spawn import run_distributed  # noqa: E402

MARKERS = "<!-- bench:begin -->", "<!-- bench:end -->"
ACCUM_MARKERS = "<!-- bench-accum:begin -->", "<!-- bench-accum:end -->"
TP_MARKERS = "<!-- bench-2d:begin -->", "<!-- bench-2d:end -->"
COLUMNS = (
    "system", "ms/step", "vs FSDP2", "CPU ms/step", "vs FSDP2", "tokens/s", "peak MiB",
    "vs FSDP2", "resident MiB", "RSS MiB", "vs FSDP2", "comm MiB/step", "vs FSDP2",
    "vs floor", "loss@0", "loss@last",
)  # fmt: skip
TP_SYSTEMS = {"fsdp_lite", "fsdp_lite-nocheck", "fsdp2"}
RATIO_KEYS = ("median_step_s", "median_cpu_s", "peak_bytes", "rss_peak_bytes", "comm_wire_bytes")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bm.make_parser(__doc__)
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma-separated subset of %(default)s"
    )
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated: fp32,bf16")
    p.add_argument("--steps", type=int, default=20, help="timed steps (>= 10 for the report)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones")
    p.add_argument("--rounds", type=int, default=1, help="repeat every case, interleaved")
    p.add_argument("--profile-steps", type=int, default=3, help="steps of the memory-profiled pass")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads per rank (default: cores // W)"
    )
    bm.add_config_args(
        p, BenchConfig(),
        ("layers", "dim", "heads", "seq", "batch", "micro", "tp", "vocab", "seed"),
        helps={
            "batch": "sequences per rank per micro-batch",
            "tp": "tensor-parallel degree (a dp x tp mesh; fsdp_lite and fsdp2 only)",
            "micro": "micro-batches per step (each system accumulating at its best)",
        },
    )  # fmt: skip
    p.add_argument(
        "--checkpoint", action="store_true", help="activation-checkpoint every block (all systems)"
    )
    bm.add_output_args(p, json_default=None)
    args = p.parse_args(argv)
    args.systems = bm.pick(args.systems, SYSTEMS, "--systems")
    args.precisions = bm.pick(args.precisions, PRECISIONS, "--precisions")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.world_size)
    if args.tp > 1 and (args.world_size % args.tp or set(args.systems) - TP_SYSTEMS):
        p.error(f"--tp must divide --world-size and needs --systems among {sorted(TP_SYSTEMS)}")
    if args.json is None:
        tail = "_2d.json" if args.tp > 1 else "_accum.json" if args.micro > 1 else ".json"
        args.json = args.out.with_name(args.out.stem + tail)
    if min(args.steps, args.profile_steps, args.world_size, args.rounds) < 1 or args.warmup < 0:
        p.error("need --steps, --profile-steps, --world-size, --rounds >= 1 and --warmup >= 0")
    return args


def run_case(system: str, precision: str, cfg: BenchConfig, world: int) -> list[dict[str, Any]]:
    """``world`` fresh ranks for one case; each rank's result."""
    return run_distributed(
        rank_main, world, system, precision, cfg,
        cuda=bm.use_cuda(world), threads=cfg.threads, timeout=cfg.timeout_s,
    )  # fmt: skip


def run_all(args: argparse.Namespace, cfg: BenchConfig) -> dict[str, dict[str, dict]]:
    """Every case, ``args.rounds`` times over, systems interleaved so that load from other
    work on the machine spreads over all of them; step times pool across rounds. Each round
    starts one system later in the list: the first case of a round measured ~10 ms/step
    slower than the same system run second (fsdp_lite vs fsdp_lite-nocheck, both orders)."""
    raw: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rnd in range(args.rounds):
        for precision in args.precisions:
            for system in bm.round_order(args.systems, rnd):
                print(
                    f"[bench] round {rnd + 1}/{args.rounds}: {system} {precision} ...", flush=True
                )
                ranks = run_case(system, precision, cfg, args.world_size)
                if (system, precision) in raw:  # memory and bytes: the first round's
                    for old, new in zip(raw[system, precision], ranks, strict=True):
                        old["step_times_s"] += new["step_times_s"]
                        old["step_cpu_s"] += new["step_cpu_s"]
                else:
                    raw[system, precision] = ranks
                ms = statistics.median(bm.slowest_per_step(r["step_times_s"] for r in ranks)) * 1e3
                print(f"[bench]   {ms:.1f} ms/step, loss@0 {ranks[0]['losses'][0]:.6f}")
    results: dict[str, dict[str, dict]] = {}
    for precision in args.precisions:
        for system in args.systems:
            ranks = raw[system, precision]
            results.setdefault(precision, {})[system] = summarize(ranks, cfg, args.world_size)
    return results


def summarize(ranks: list[dict[str, Any]], cfg: BenchConfig, world: int) -> dict[str, Any]:
    """One case's figures from its ranks: the slowest rank per step, the largest memory."""
    per_step = bm.slowest_per_step(r["step_times_s"] for r in ranks)
    median = statistics.median(per_step)
    comm = [sum(c["wire_bytes"] for c in r["comm_per_step"].values()) for r in ranks]
    return {
        "median_step_s": median,
        "min_step_s": min(per_step),
        "median_cpu_s": statistics.median(bm.slowest_per_step(r["step_cpu_s"] for r in ranks)),
        "tokens_per_s": world // cfg.tp * cfg.batch * cfg.micro * cfg.seq / median,
        "peak_bytes": max(r["memory"]["peak_bytes"] for r in ranks),
        "resident_bytes": max(r["memory"]["resident_bytes"] for r in ranks),
        "rss_peak_bytes": max(r["rss_peak_bytes"] for r in ranks),
        "comm_wire_bytes": max(comm),
        "comm_per_step": ranks[0]["comm_per_step"],
        "loss0": statistics.fmean(r["losses"][0] for r in ranks),
        "loss_last": statistics.fmean(r["losses"][-1] for r in ranks),
        "library": ranks[0]["library"],
        "ranks": ranks,
    }


def zero3_floor(num_params: int, precision: str, world: int) -> float:
    """Bytes per rank per step: 2 all-gathers (compute dtype) + 1 reduce-scatter (fp32)."""
    compute = 2 if precision == "bf16" else 4
    return (world - 1) / world * num_params * (2 * compute + 4)


def table(precision: str, results: dict[str, dict], floor: float) -> list[str]:
    """Markdown rows for one precision; ratios against FSDP2 when it ran."""
    ref = results.get("fsdp2")
    rows = []
    for system, r in results.items():
        vs = {k: bm.ratio(r[k], ref[k] if ref else None) for k in RATIO_KEYS}
        cells = [
            system,
            f"{r['median_step_s'] * 1e3:.1f}",
            vs["median_step_s"],
            f"{r['median_cpu_s'] * 1e3:.0f}",
            vs["median_cpu_s"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['peak_bytes'] / bm.MIB:.1f}",
            vs["peak_bytes"],
            f"{r['resident_bytes'] / bm.MIB:.1f}",
            f"{r['rss_peak_bytes'] / bm.MIB:.0f}",
            vs["rss_peak_bytes"],
            f"{r['comm_wire_bytes'] / bm.MIB:.2f}",
            vs["comm_wire_bytes"],
            bm.ratio(r["comm_wire_bytes"], floor),
            f"{r['loss0']:.6f}",
            f"{r['loss_last']:.4f}",
        ]
        rows.append(cells)
    head = f"**{precision}** — ZeRO-3 floor {floor / bm.MIB:.2f} MiB/step/rank"
    return [head, "", *bm.md_table(COLUMNS, rows, "l" + "r" * (len(COLUMNS) - 1))]


def loss_check(precision: str, results: dict[str, dict]) -> str:
    """Step-0 losses must agree: same init, same data (bf16 within rounding)."""
    losses = {s: r["loss0"] for s, r in results.items()}
    spread = max(losses.values()) - min(losses.values())
    tol = 1e-5 if precision == "fp32" else 2e-2
    verdict = "OK" if spread <= tol else "MISMATCH"
    return f"loss@0 spread across systems: {spread:.2e} (tolerance {tol:.0e}) — {verdict}"


def library_lines(results: dict[str, dict[str, dict]]) -> list[str]:
    """fsdp_lite's own accounting of its last timed step, next to what the benchmark saw."""
    lines = []
    for precision, by_system in results.items():
        r = by_system.get("fsdp_lite")
        lib = r and r.get("library")
        if not lib:
            continue
        last = lib["last_step"]
        comm = last.get("collectives", last)
        ops = ", ".join(
            f"{op} {s['calls']}x {s['bytes'] / bm.MIB:.2f} MiB"
            for op, s in comm.items()
            if isinstance(s, dict) and "bytes" in s
        )
        seen = ", ".join(
            f"{op} {c['calls']:.0f}x {c['bytes'] / bm.MIB:.2f} MiB"
            for op, c in r["comm_per_step"].items()
        )
        parts = [
            f"`{lib['api']}` per step (full-buffer bytes): {ops or 'none'} "
            f"(observed at the ProcessGroup: {seen})"
        ]
        if "exposed_fraction" in lib:
            parts.append(
                f"exposed communication {lib['exposed_s_median'] * 1e3:.1f} ms/step "
                f"(median), {lib['exposed_fraction']:.0%} of step time"
            )
        if "full_bytes_peak" in lib:
            parts.append(f"full parameters at peak {lib['full_bytes_peak'] / bm.MIB:.2f} MiB")
        if isinstance(mem := lib.get("memory_stats"), dict):
            parts.append(", ".join(f"{k} {v / bm.MIB:.2f} MiB" for k, v in mem.items()))
        if "unsharded_units_peak" in last:
            parts.append(f"at most {last['unsharded_units_peak']} units unsharded at once")
        lines.append(f"- {precision}: " + "; ".join(parts))
    return lines


def fsdp_bytes_lines(results: dict[str, dict[str, dict]], dp: int) -> list[str]:
    """Under TP: fsdp_lite's own collectives (TP's are DTensor's, uncounted) against their
    floor on this rank's local parameters: 2 gathers (the root's once: it stays gathered
    for backward) in the compute dtype and 1 reduce-scatter in fp32, full-buffer bytes."""
    lines = []
    for precision, by_system in results.items():
        r = by_system.get("fsdp_lite")
        if not r or not r.get("library"):
            continue
        comm = r["library"]["last_step"].get("collectives", {})
        got = sum(comm[op]["bytes"] for op in ("all_gather", "reduce_scatter") if op in comm)
        rank = r["ranks"][0]
        psi, root = rank["num_params_local"] * dp, rank["root_params_local"] * dp
        compute = 2 if precision == "bf16" else 4
        floor = (2 * psi - root) * compute + psi * 4
        lines.append(
            f"- {precision}: fsdp_lite's FSDP collectives {got / bm.MIB:.3f} MiB/step/rank "
            f"(full buffers) vs their floor on the local Ψ = {psi:,} (padded) "
            f"{floor / bm.MIB:.3f} MiB: {got / floor:.3f}x"
        )
    return lines


def report(
    args: argparse.Namespace, cfg: BenchConfig, results: dict, info: dict, markers: tuple
) -> str:
    """The markdown block between the bench markers of BENCHMARKS.md."""
    psi, m = info["num_params"], info["machine"]
    micro = f" x {cfg.micro} micro-batches, each system accumulating at its best"
    micro = micro if cfg.micro > 1 else ""
    tp = f"TP {cfg.tp} (parallelize_gpt) x dp {args.world_size // cfg.tp}, " if cfg.tp > 1 else ""
    lines = [
        markers[0],
        f"{bm.run_line(info['date'], m, gpu=True)}, load average at start {m['load_avg']}, "
        f"at end {info['load_avg_end']}.",
        "",
        f"    {info['command']}",
        "",
        f"GPT: {cfg.layers} blocks, dim {cfg.dim}, {cfg.heads} heads, seq {cfg.seq}, "
        f"batch {cfg.batch}/rank{micro}, vocab {cfg.vocab}, tied embedding, "
        f"{tp}"
        f"Ψ = {psi:,} parameters"
        f"{', every block activation-checkpointed' if cfg.checkpoint else ''}; "
        f"W={args.world_size} ({info['backend']}), {cfg.threads} thread(s)/rank, AdamW; "
        f"median of {cfg.steps} steps after {cfg.warmup} warm-up"
        f"{f' in each of {args.rounds} interleaved rounds' if args.rounds > 1 else ''} "
        "(slowest rank per step).",
        "",
    ]
    for precision, by_system in results.items():
        floor = zero3_floor(psi, precision, args.world_size)
        if cfg.tp > 1:  # the dp ranks' floor on one rank's local parameters
            dp = args.world_size // cfg.tp
            local = next(iter(by_system.values()))["ranks"][0]["num_params_local"] * dp
            floor = zero3_floor(local, precision, dp)
        lines += table(precision, by_system, floor)
        lines += ["", loss_check(precision, by_system), ""]
    lib = library_lines(results)
    if lib:
        lines += ["fsdp_lite's own accounting:", "", *lib, ""]
    if cfg.tp > 1:
        lines += [*fsdp_bytes_lines(results, args.world_size // cfg.tp), ""]
    lines.append(markers[1])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = bm.config_from_args(BenchConfig, args)
    info = bm.run_info("scripts/bench.py", argv)
    info["backend"] = "nccl" if bm.use_cuda(args.world_size) else "gloo"
    info["num_params"] = bm.count_params(lambda: GPT(cfg.gpt_config()))
    info["config"] = dataclasses.asdict(cfg)
    results = run_all(args, cfg)
    info["load_avg_end"] = bm.load_avg()
    markers = TP_MARKERS if cfg.tp > 1 else MARKERS if cfg.micro == 1 else ACCUM_MARKERS
    block = report(args, cfg, results, info, markers)
    bm.publish(block, {"info": info, "results": results}, args, markers, "bench")


if __name__ == "__main__":
    main()
