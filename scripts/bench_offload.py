"""Resident memory and step time with no offload, CPU offload and SSD offload.

    python scripts/bench_offload.py [--layers 8 --dim 1024 --vocab 8192 --steps 4 --world-size 2]

A model whose state dominates memory (default ~109M parameters; batch 1, sequence 64)
trains with AdamW on W gloo ranks, each offload mode in fresh processes. Per rank it
reports resident memory between steps (VmRSS after a step), the peak during a step
(VmHWM, reset before the last step), median step time, and the model-state bytes each
mode moves off the heap (shards + grads + AdamW moments = 16 bytes per parameter / W).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # measure this checkout's fsdp_lite

import bench_measure as bm  # noqa: E402

import fsdp_lite  # noqa: E402
from fsdp_lite.testing.models import GPT, Block, GPTConfig  # noqa: E402
from fsdp_lite.testing.spawn import run_distributed  # noqa: E402


def _rank(rank: int, world: int, mode: str, args: dict, tmp: str) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(args["vocab"], 64, args["layers"], 8, args["dim"], 0.0)
    offload = {"none": None, "cpu": fsdp_lite.CPUOffload(), "ssd": fsdp_lite.SSDOffload(tmp)}[mode]
    model = fsdp_lite.FSDPModule(
        GPT(cfg), auto_wrap_policy=fsdp_lite.wrap.by_type(Block), offload=offload
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if mode == "ssd":
        fsdp_lite.offload_optimizer_state(opt, model)
    gen = torch.Generator().manual_seed(rank)
    rss, times = [], []
    for step in range(args["steps"]):
        if step == args["steps"] - 1:
            bm.reset_peak_rss()
        x = torch.randint(0, cfg.vocab_size, (1, 64), generator=gen)
        watch = bm.Stopwatch()
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
        times.append(watch.wall())
        rss.append(bm.rss_bytes())
    n_params = sum(p.numel() for p in model.parameters()) * world
    return {
        "rss_between_steps": rss[-1],
        "peak_rss_last_step": bm.peak_rss_bytes(),
        "median_step_s": statistics.median(times[1:]),
        "model_state_bytes": 16 * n_params // world,
        "params": n_params,
    }


def main() -> None:
    p = bm.make_parser(__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--table-from", default=None, help="print the table of an earlier --json")
    args = vars(p.parse_args())
    if args["table_from"]:
        with open(args["table_from"]) as f:
            saved = json.load(f)
        print(_table(saved["results"], saved["args"]))
        return
    # Large allocations as mmaps, so freed memory leaves the process and RSS is honest.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    results = {}
    for mode in ("none", "cpu", "ssd"):
        with tempfile.TemporaryDirectory(prefix="fsdp_lite_ssd_") as tmp:
            per_rank = run_distributed(_rank, args["world_size"], mode, args, tmp, timeout=1800)
        results[mode] = per_rank[0]
        print(f"{mode}: {per_rank[0]}", file=sys.stderr)
    print(_table(results, args))
    if args["json"]:
        bm.write_json(args["json"], {"args": args, "results": results})


def _table(results: dict, args: dict) -> str:
    base = results["none"]
    state = base["model_state_bytes"]
    # Between steps zero_grad(set_to_none=True) has freed the grads in every mode, so the
    # model state resident then is the shards and AdamW's two moments: 12 of the 16 bytes.
    between = state * 12 // 16
    head = (
        f"{base['params'] / 1e6:.1f}M parameters, W={args['world_size']}; model state per rank "
        f"{state / bm.MIB:.0f} MiB (fp32 shard + grad + AdamW moments), of which "
        f"{between / bm.MIB:.0f} MiB (shard + moments) is resident between steps"
    )
    columns = (
        "offload", "RSS between steps (MiB)", "peak RSS in a step (MiB)",
        "saved between steps (% of resident model state)", "median step (s)",
        "step time vs none",
    )  # fmt: skip
    rows = []
    for mode, r in results.items():
        saved = base["rss_between_steps"] - r["rss_between_steps"]
        rows.append(
            [mode, f"{r['rss_between_steps'] / bm.MIB:.0f}",
             f"{r['peak_rss_last_step'] / bm.MIB:.0f}",
             f"{saved / bm.MIB:.0f} MiB ({100 * saved / between:.0f}%)",
             f"{r['median_step_s']:.2f}", bm.ratio(r["median_step_s"], base["median_step_s"])]
        )  # fmt: skip
    return "\n".join([head, "", *bm.md_table(columns, rows, "llllll")])


if __name__ == "__main__":
    main()
