"""Host overhead per unit: what each system adds to a training step of many small blocks,
where Python, not arithmetic, sets the pace.

    .venv/bin/python scripts/bench_host.py [--layers 64 --rounds 5 --steps 10]

One process, torch's fake process group at W=8 (collectives are no-ops that complete at
once), so the figures are each system's own host work: hooks, casts, copies, bookkeeping.
Every system gets the same GPT of ``--layers`` tiny blocks (one unit per block plus the
root), the same batch and AdamW; the unwrapped model trains alone (bf16: under autocast).
Rounds interleave the systems (a different order each round), each round times
``--steps`` steps per system after warm-up; the figure is the median over all timed steps.
Per-unit overhead = (system's step - unwrapped step) / units, for the whole step and for
forward+backward alone (the optimizer step is where flat params save the most).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # measure this checkout's fsdp_lite

import bench_measure as bm  # noqa: E402
from bench_systems import PRECISIONS, BenchConfig, _wrap  # noqa: E402

from fsdp_lite.testing.models import GPT  # noqa: E402

MARKERS = "<!-- bench-host:begin -->", "<!-- bench-host:end -->"
SYSTEMS = ("unwrapped", "fsdp_lite", "fsdp_lite-orig", "fsdp_lite-whole", "fsdp2", "fsdp1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bm.make_parser(__doc__)
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per system per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    bm.add_output_args(p, ROOT / "BENCHMARKS_host.json")
    args = p.parse_args(argv)
    args.precisions = bm.pick(args.precisions, PRECISIONS, "--precisions")
    args.systems = bm.pick(args.systems, SYSTEMS, "--systems")
    return args


def config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(layers=args.layers, dim=args.dim, heads=2, seq=16, batch=2, vocab=128)


def build(system: str, precision: str, cfg: BenchConfig) -> nn.Module:
    if system == "unwrapped":
        torch.manual_seed(cfg.seed)
        return GPT(cfg.gpt_config())
    return _wrap(system, precision, cfg, torch.device("cpu"))


class Case:
    """One system in one precision: its model, optimizer, and timings of each phase."""

    def __init__(self, system: str, precision: str, cfg: BenchConfig) -> None:
        self.system = system
        self.model = build(system, precision, cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.autocast = system == "unwrapped" and precision == "bf16"
        g = torch.Generator().manual_seed(cfg.seed)
        tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
        self.x, self.y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        self.step_s: list[float] = []
        self.fwd_bwd_s: list[float] = []

    def step(self, record: bool) -> None:
        watch = bm.Stopwatch()
        self.opt.zero_grad(set_to_none=True)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else None
        with ctx or contextlib.nullcontext():
            _, loss = self.model(self.x, self.y)
        loss.backward()
        fwd_bwd = watch.wall()
        self.opt.step()
        step = watch.wall()
        if record:
            self.fwd_bwd_s.append(fwd_bwd)
            self.step_s.append(step)


def run(args: argparse.Namespace, precision: str, cfg: BenchConfig) -> dict[str, dict]:
    cases = [Case(s, precision, cfg) for s in args.systems]
    for case in cases:
        for _ in range(args.warmup):
            case.step(record=False)
    for r in range(args.rounds):
        for case in bm.round_order(cases, r):
            for _ in range(args.steps):
                case.step(record=True)
    return {
        c.system: {
            "step_s": statistics.median(c.step_s),
            "fwd_bwd_s": statistics.median(c.fwd_bwd_s),
            "units": _units(c.system, cfg),
        }
        for c in cases
    }


def _units(system: str, cfg: BenchConfig) -> int:
    return 0 if system == "unwrapped" else cfg.layers + 1


def table(precision: str, res: dict[str, dict]) -> list[str]:
    base = res.get("unwrapped")
    peer = res.get("fsdp2")

    def per_unit(name: str, key: str) -> float | None:
        r = res[name]
        if base is None or not r["units"]:
            return None
        return (r[key] - base[key]) / r["units"] * 1e6

    rows = []
    for name, r in res.items():
        cells = [name, f"{r['step_s'] * 1e3:.1f}"]
        for key in ("step_s", "fwd_bwd_s"):
            if key == "fwd_bwd_s":
                cells.append(f"{r[key] * 1e3:.1f}")
            mine = per_unit(name, key)
            ref = per_unit("fsdp2", key) if peer else None
            cells.append("" if mine is None else f"{mine:.0f}")
            cells.append("" if mine is None else bm.ratio(mine, ref, unit="×", missing=""))
        rows.append(cells)
    columns = (
        "system", "ms/step", "µs/unit over unwrapped", "vs FSDP2", "fwd+bwd ms",
        "µs/unit fwd+bwd", "vs FSDP2",
    )  # fmt: skip
    return [f"**{precision}**", "", *bm.md_table(columns, rows, "l" * len(columns))]


def report(args: argparse.Namespace, cfg: BenchConfig, results: dict, command: str) -> str:
    lines = [
        MARKERS[0],
        "## Host overhead per unit",
        "",
        f"{bm.run_line(bm.now(), bm.machine())}.",
        "",
        f"    {command}",
        "",
        f"Fake process group, W={args.world_size} (collectives complete at once: host work "
        f"only), one process, 1 thread. GPT of {cfg.layers} blocks, dim {cfg.dim}, seq "
        f"{cfg.seq}, batch {cfg.batch}: {cfg.layers + 1} units. AdamW. Median over "
        f"{args.rounds} interleaved rounds of {args.steps} steps per system.",
        "",
    ]
    for precision, res in results.items():
        lines += table(precision, res) + [""]
    lines.append(MARKERS[1])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = config(args)
    with bm.fake_group(0, args.world_size):
        results = {p: run(args, p, cfg) for p in args.precisions}
    command = bm.command_line("scripts/bench_host.py", argv)
    block = report(args, cfg, results, command)
    bm.publish(block, {"command": command, "results": results}, args, MARKERS, "bench-host")


if __name__ == "__main__":
    main()
