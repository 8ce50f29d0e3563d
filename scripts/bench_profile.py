"""Where one system's step time goes: torch.profiler's op table for rank 0.

    .venv/bin/python scripts/bench_profile.py fsdp_lite bf16 [--steps 6 --warmup 4 --rows 30]

Same model, data and wrapping as ``scripts/bench.py`` (``bench_systems.build_system``),
W=2 gloo, one thread per rank. Times in the table are wall time inside each op on the main
thread (a blocking wait on a collective counts as the self time of the enclosing
``fsdp_lite::*`` / ``FSDP::*`` / ``FullyShardedDataParallel.*`` record).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # measure this checkout's fsdp_lite

import bench_measure as bm  # noqa: E402
import bench_systems as bs  # noqa: E402

from fsdp_lite.testing.memory import QuietProfile  # noqa: E402
from fsdp_lite.testing.spawn import run_distributed  # noqa: E402


def _rank(rank: int, world: int, args: argparse.Namespace) -> str | None:
    """One rank: warm-up, then profiled steps; rank 0's op table."""
    cfg, device = bs.BenchConfig(), torch.device("cpu")
    batches = bs.make_batches(cfg, rank, args.warmup + args.steps, device)
    model = bs.build_system(args.system, args.precision, cfg, device)
    opt = bs._make_optimizer(model, cfg)
    autocast = args.system == "ddp" and args.precision == "bf16"
    for batch in batches[: args.warmup]:
        bs.train_step(model, opt, batch, autocast)
    with QuietProfile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches[args.warmup :]:
            bs.train_step(model, opt, batch, autocast)
    if rank != 0:
        return None
    table = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60
    )
    return f"{args.system} {args.precision}, {args.steps} steps, rank 0\n{table}"


def main() -> None:
    parser = bm.make_parser(__doc__)
    parser.add_argument("system", choices=bs.SYSTEMS)
    parser.add_argument("precision", choices=bs.PRECISIONS)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    print(run_distributed(_rank, 2, args, timeout=600)[0])


if __name__ == "__main__":
    main()
