"""LoRA memory benchmark: per-rank peak memory during backward, everything trainable vs a
frozen base with LoRA adapters (the same Llama, the same batch, one unit per decoder layer).

    .venv/bin/python scripts/bench_lora.py [--layers 8 --hidden 256 --rounds 3 --steps 3]

W ranks (gloo on CPU, ``fsdp_lite.testing.run_distributed``) train one PEFT model (LoRA on
q_proj and v_proj) in two modes: ``full`` makes every parameter trainable, ``lora`` only
the adapters. Rounds alternate the modes (full, lora, full, lora, ...); each figure is the
median over rounds, the larger of the ranks'. Per mode:

- peak live tensor bytes inside backward (torch.profiler allocator events, the profiler
  started before the model exists; backward passes after the first step, which is the
  one without optimizer state),
- peak bytes of gathered full parameters during backward and the most units gathered at
  once (``fsdp_lite.stats()``: ``full_bytes_peak``, ``unsharded_units_peak``, reset
  between forward and backward).

A frozen flat param gets no gradient, so no post-backward hook frees it; fsdp_lite frees
it once its unit's backward is over (see ``fsdp_lite/core/unit.py``). Before that, the LoRA run
held every layer's base until the end of backward (9 of 9 units, 3.2x the full run's
gathered bytes); now both hold the same 3 units.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler import record_function

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # measure this checkout's fsdp_lite

import bench_measure as bm  # noqa: E402

import fsdp_lite  # noqa: E402
from fsdp_lite.testing.memory import MemoryRecorder  # noqa: E402
from fsdp_lite.testing.spawn import run_distributed  # noqa: E402

MODES = ("full", "lora")
BACKWARD = "bench::backward"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bm.make_parser(__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps per run; the first is not measured")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args(argv)
    if args.steps < 2 or args.rounds < 1 or args.world_size < 1 or args.hidden % 64:
        p.error("need --steps >= 2, --rounds >= 1, --world-size >= 1, --hidden a multiple of 64")
    return args


def build_model(args: argparse.Namespace, mode: str) -> torch.nn.Module:
    """The same PEFT Llama in both modes (seeded); ``full`` unfreezes the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=args.seq,
        tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    lora = LoraConfig(r=args.lora_rank, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(LlamaForCausalLM(cfg), lora)
    if mode == "full":
        for p in model.parameters():
            p.requires_grad_(True)
    return model


def measure(args: argparse.Namespace, mode: str, x: torch.Tensor) -> dict[str, Any]:
    """Build, wrap and train ``args.steps`` steps under the profiler; this rank's figures."""
    full_peaks, unit_peaks = [], []
    with MemoryRecorder("cpu", label=BACKWARD) as rec:
        model = build_model(args, mode)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        policy = fsdp_lite.wrap.by_type(*fsdp_lite.wrap.transformer_layers(model))
        model = fsdp_lite.FSDPModule(model, auto_wrap_policy=policy)
        units = sum(isinstance(m, fsdp_lite.FSDPModule) for m in model.modules())
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        for step in range(args.steps):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            fsdp_lite.reset_stats()
            with record_function(BACKWARD):
                loss.backward()
            s = fsdp_lite.stats()
            if step > 0:
                full_peaks.append(s["full_bytes_peak"])
                unit_peaks.append(s["unsharded_units_peak"])
            if s["full_bytes_now"]:
                raise RuntimeError(f"{mode}: {s['full_bytes_now']} full bytes left after backward")
            opt.step()
            opt.zero_grad()
        largest_unit = model.memory_stats()["largest_unit_full_bytes"]
        del model, opt, loss
    return {
        "peak_bytes": rec.peak_bytes,
        "full_bytes_peak": max(full_peaks),
        "units_peak": max(unit_peaks),
        "units": units,
        "largest_unit_bytes": largest_unit,
        "trainable": trainable,
        "params": total,
    }


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, list[dict]]:
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, args.vocab, (args.batch * world, args.seq), generator=g).chunk(world)[rank]
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:  # interleaved: drift in machine load hits both modes alike
            results[mode].append(measure(args, mode, x))
    return results


def summarize(ranks: list[dict[str, list[dict]]]) -> dict[str, dict[str, float]]:
    """Per mode and figure: the median over rounds of each rank, then the largest rank."""
    out: dict[str, dict[str, float]] = {}
    for mode in MODES:
        keys = ranks[0][mode][0]
        out[mode] = {
            k: max(statistics.median(r[k] for r in rank[mode]) for rank in ranks) for k in keys
        }
    return out


def table(s: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    full, lora = s["full"], s["lora"]
    columns = (
        "mode", "trainable params", "peak MiB in backward", "gathered full params, peak MiB",
        "units gathered at once",
    )  # fmt: skip
    rows = []
    for mode in MODES:
        r = s[mode]
        units = f"{r['units_peak']:.0f} of {r['units']:.0f}"
        rows.append(
            [mode, f"{r['trainable'] / 1e6:.2f} M", f"{r['peak_bytes'] / bm.MIB:.1f}",
             f"{r['full_bytes_peak'] / bm.MIB:.1f}", units]
        )  # fmt: skip
    ratios = [
        "lora / full",
        bm.ratio(lora["trainable"], full["trainable"], digits=3, unit=""),
        *(bm.ratio(lora[k], full[k]) for k in ("peak_bytes", "full_bytes_peak", "units_peak")),
    ]
    head = (
        f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab} "
        f"({full['params'] / 1e6:.2f} M params; largest unit "
        f"{full['largest_unit_bytes'] / bm.MIB:.1f} MiB full), LoRA r={args.lora_rank} on "
        f"q_proj/v_proj; W={args.world_size} gloo CPU, "
        f"{args.batch}x{args.seq} tokens per rank; median of {args.rounds} interleaved rounds, "
        f"largest rank, backward of steps 2..{args.steps}."
    )
    return head + "\n\n" + "\n".join([*bm.md_table(columns, rows, "lrrrr"), bm.md_row(ratios)])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ranks = run_distributed(rank_main, args.world_size, args, timeout=900.0)
    print(table(summarize(ranks), args))


if __name__ == "__main__":
    main()
