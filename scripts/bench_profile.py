"""Where one system's step time goes: torch.profiler's op table for rank 0.

    .venv/bin/python scripts/bench_profile.py fsdp_lite bf16 [--steps 6 --warmup 4 --rows 30]

Same model, data and wrapping as ``scripts/bench.py`` (``bench_systems.build_system``),
W=2 gloo, one thread per rank. Times in the table are wall time inside each op on the main
thread (a blocking wait on a collective counts as the self time of the enclosing
``fsdp_lite::*`` / ``FSDP::*`` / ``FullyShardedDataParallel.*`` record).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_systems as bs  # noqa: E402


def _rank(rank: int, args: argparse.Namespace, init_file: str, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cfg, device = bs.BenchConfig(), torch.device("cpu")
        batches = bs.make_batches(cfg, rank, args.warmup + args.steps, device)
        model = bs.build_system(args.system, args.precision, cfg, device)
        opt = bs._make_optimizer(model, cfg)
        autocast = args.system == "ddp" and args.precision == "bf16"
        for batch in batches[: args.warmup]:
            bs.train_step(model, opt, batch, autocast)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for batch in batches[args.warmup :]:
                bs.train_step(model, opt, batch, autocast)
        if rank == 0:
            table = prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60
            )
            out.put(f"{args.system} {args.precision}, {args.steps} steps, rank 0\n{table}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("system", choices=bs.SYSTEMS)
    parser.add_argument("precision", choices=bs.PRECISIONS)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_rank, args=(r, args, init_file, out)) for r in range(2)]
        for p in procs:
            p.start()
        print(out.get())
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            sys.exit("a rank failed (see above)")


if __name__ == "__main__":
    main()
