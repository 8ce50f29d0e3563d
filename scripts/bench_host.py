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
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import machine, write_markdown  # noqa: E402
from bench_systems import BenchConfig, _wrap  # noqa: E402

from fsdp_lite.testing.models import GPT  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench-host:begin -->", "<!-- bench-host:end -->"
SYSTEMS = ("unwrapped", "fsdp_lite", "fsdp_lite-orig", "fsdp_lite-whole", "fsdp2", "fsdp1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per system per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    p.add_argument("--json", type=Path, default=ROOT / "BENCHMARKS_host.json")
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


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
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else None
        with ctx or contextlib.nullcontext():
            _, loss = self.model(self.x, self.y)
        loss.backward()
        t1 = time.perf_counter()
        self.opt.step()
        t2 = time.perf_counter()
        if record:
            self.fwd_bwd_s.append(t1 - t0)
            self.step_s.append(t2 - t0)


def run(args: argparse.Namespace, precision: str, cfg: BenchConfig) -> dict[str, dict]:
    systems = args.systems.split(",")
    cases = [Case(s, precision, cfg) for s in systems]
    for case in cases:
        for _ in range(args.warmup):
            case.step(record=False)
    for r in range(args.rounds):
        order = cases[r % len(cases) :] + cases[: r % len(cases)]
        for case in order:
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

    lines = [
        f"**{precision}**",
        "",
        "| system | ms/step | µs/unit over unwrapped | vs FSDP2 | fwd+bwd ms | "
        "µs/unit fwd+bwd | vs FSDP2 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        cells = [name, f"{r['step_s'] * 1e3:.1f}"]
        for key in ("step_s", "fwd_bwd_s"):
            if key == "fwd_bwd_s":
                cells.append(f"{r[key] * 1e3:.1f}")
            mine = per_unit(name, key)
            ref = per_unit("fsdp2", key) if peer else None
            cells.append("" if mine is None else f"{mine:.0f}")
            cells.append(f"{mine / ref:.2f}×" if mine is not None and ref else "")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(args: argparse.Namespace, cfg: BenchConfig, results: dict, command: str) -> str:
    m = machine()
    lines = [
        BEGIN,
        "## Host overhead per unit",
        "",
        f"Run {datetime.datetime.now().astimezone().isoformat(timespec='seconds')} on "
        f"{m['cpu']} ({m['cores']} cores), torch {m['torch']}, commit {m['commit']}.",
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
    lines.append(END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # whole params on the fake process group: rows no rank sends stay uninitialized, and
    # denormals among them would slow the arithmetic; the host work is what is measured
    torch.set_flush_denormal(True)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    cfg = config(args)
    results = {p: run(args, p, cfg) for p in args.precisions.split(",")}
    command = shlex.join(
        [".venv/bin/python", "scripts/bench_host.py", *(sys.argv[1:] if argv is None else argv)]
    )
    block = report(args, cfg, results, command)
    print(block)
    if not args.no_write:
        write_markdown(args.out, block, BEGIN, END)
        args.json.write_text(json.dumps({"command": command, "results": results}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
