"""Resident memory and step time with no offload, CPU offload and SSD offload.

    python scripts/bench_offload.py [--layers 8 --dim 1024 --vocab 8192 --steps 4 --world-size 2]

A model whose state dominates memory (default ~109M parameters; batch 1, sequence 64)
trains with AdamW on W gloo ranks, each offload mode in fresh processes. Per rank it
reports resident memory between steps (VmRSS after a step), the peak during a step
(VmHWM, reset before the last step), median step time, and the model-state bytes each
mode moves off the heap (shards + grads + AdamW moments = 16 bytes per parameter / W).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import fsdp_lite
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.models import GPT, Block, GPTConfig

MiB = 2**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


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
            _reset_peak()
        x = torch.randint(0, cfg.vocab_size, (1, 64), generator=gen)
        t0 = time.perf_counter()
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        rss.append(_status_kib("VmRSS") * 1024)
    n_params = sum(p.numel() for p in model.parameters()) * world
    return {
        "rss_between_steps": rss[-1],
        "peak_rss_last_step": _status_kib("VmHWM") * 1024,
        "median_step_s": statistics.median(times[1:]),
        "model_state_bytes": 16 * n_params // world,
        "params": n_params,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        with open(args["json"], "w") as f:
            json.dump({"args": args, "results": results}, f, indent=2)


def _table(results: dict, args: dict) -> str:
    base = results["none"]
    state = base["model_state_bytes"]
    # Between steps zero_grad(set_to_none=True) has freed the grads in every mode, so the
    # model state resident then is the shards and AdamW's two moments: 12 of the 16 bytes.
    between = state * 12 // 16
    lines = [
        f"{base['params'] / 1e6:.1f}M parameters, W={args['world_size']}; model state per rank "
        f"{state / MiB:.0f} MiB (fp32 shard + grad + AdamW moments), of which "
        f"{between / MiB:.0f} MiB (shard + moments) is resident between steps",
        "",
        "| offload | RSS between steps (MiB) | peak RSS in a step (MiB) | saved between steps "
        "(% of resident model state) | median step (s) | step time vs none |",
        "|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        saved = base["rss_between_steps"] - r["rss_between_steps"]
        lines.append(
            f"| {mode} | {r['rss_between_steps'] / MiB:.0f} | {r['peak_rss_last_step'] / MiB:.0f} "
            f"| {saved / MiB:.0f} MiB ({100 * saved / between:.0f}%) | {r['median_step_s']:.2f} "
            f"| {r['median_step_s'] / base['median_step_s']:.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
