"""Scale table (issue 17): per-rank memory of fsdp_lite and FSDP2 as W grows.

    PYTHONPATH=.:scripts .venv/bin/python scripts/bench_scale.py [--worlds 8,64,512]
        [--systems fsdp_lite,fsdp2] [--layers 24 --dim 2048 --heads 16 --vocab 50304]
        [--seq 128 --batch 1] [--steps 3] [--no-write]

Every (W, system) case runs one rank in its own process on a fake process group
(collectives are no-ops that copy the local shard into every chunk): what rank 0 of a real
job holds. The model is built on meta and materialized unit by unit by the system itself
(fsdp_lite's deferred init, FSDP2's ``to_empty``); shards are filled N(0, 0.02) locally.
bf16 compute, fp32 reduce, a unit per block plus the root, AdamW (``--adamw``: foreach,
CUDA's default; loop, CPU's; fused). Peak tensor memory per rank from the profiler's
allocator events (``fsdp_lite.testing.MemoryRecorder``) over the steps after the first,
which allocates the optimizer state; what is live at the peak is attributed to the region
that allocated it (``MemoryRecorder.live_at_peak``). Writes a table between the
``bench-scale`` markers of BENCHMARKS.md and the raw figures to BENCHMARKS_scale.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # measure this checkout's fsdp_lite

import bench_measure as bm  # noqa: E402
import torch  # noqa: E402
from bench_systems import tied_gpt_config  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import record_function  # noqa: E402

import fsdp_lite  # noqa: E402
from fsdp_lite.testing.memory import REGIONS, MemoryRecorder  # noqa: E402
from fsdp_lite.testing.models import GPT, Block, GPTConfig  # noqa: E402

MARKERS = "<!-- bench-scale:start -->", "<!-- bench-scale:end -->"
SYSTEMS = ("fsdp_lite", "fsdp2")
COMPUTE_DTYPE = torch.bfloat16
PHASES = ("forward", "backward", "optimizer")


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    layers: int = 24
    dim: int = 2048
    heads: int = 16
    vocab: int = 50304
    seq: int = 128
    batch: int = 1
    steps: int = 3  # profiled steps; the first (optimizer state allocation) is not counted
    seed: int = 1234
    lr: float = 1e-4
    adamw: str = "foreach"  # CUDA's default; "loop" (CPU's default) or "fused"

    def gpt_config(self) -> GPTConfig:
        return tied_gpt_config(self)


# -- one case, in its own process -------------------------------------------------------------


def build(system: str, cfg: ScaleConfig, world: int) -> nn.Module:
    """The GPT built on meta, wrapped (a unit per block plus the root), shards on CPU."""
    torch.manual_seed(cfg.seed)
    with torch.device("meta"):
        model = GPT(cfg.gpt_config())
    if system == "fsdp_lite":
        from fsdp_lite.build.deferred_init import no_init

        mp = fsdp_lite.MixedPrecision(param_dtype=COMPUTE_DTYPE, reduce_dtype=torch.float32)
        model = fsdp_lite.FSDPModule(
            model,
            auto_wrap_policy=fsdp_lite.wrap.by_type(Block),
            mixed_precision=mp,
            device=torch.device("cpu"),
            param_init_fn=no_init,
        )
        shards = list(model.parameters())
    elif system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPE, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model.to_empty(device="cpu")
        shards = [p.to_local() for p in model.parameters()]
    else:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    with torch.no_grad():
        for s in shards:
            s.normal_(std=0.02)
    return model


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> float:
    """zero_grad, forward, backward, AdamW step, each phase a profiler region."""
    x, y = batch
    opt.zero_grad(set_to_none=True)
    with record_function("bench::forward"):
        _, loss = model(x, y)
    with record_function("bench::backward"):
        loss.backward()
    with record_function("bench::optimizer"):
        opt.step()
    return loss.item()


def make_optimizer(model: nn.Module, cfg: ScaleConfig) -> torch.optim.Optimizer:
    impl = {"foreach": {"foreach": True}, "loop": {"foreach": False}, "fused": {"fused": True}}
    if cfg.adamw not in impl:
        raise ValueError(f"--adamw: unknown {cfg.adamw!r}; choose from {', '.join(impl)}")
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1, **impl[cfg.adamw])


def run_case(rank: int, world: int, system: str, cfg: ScaleConfig) -> dict[str, Any]:
    """One rank of a ``world``-rank job on the fake process group (``bench_measure.fake_rank``
    runs it): build, train ``cfg.steps`` steps under the profiler."""
    g = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    batch = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    lib = bm.LibraryAccounting(system)
    cpu = torch.device("cpu")
    watch = bm.Stopwatch()
    step_s, losses = [], []
    with MemoryRecorder(cpu, label="bench::step") as rec:
        model = build(system, cfg, world)
        build_s = watch.wall()
        opt = make_optimizer(model, cfg)
        for _ in range(cfg.steps):
            lib.before_step()
            step = bm.Stopwatch()
            with rec.step():
                losses.append(train_step(model, opt, batch))
            step_s.append(step.wall())
            lib.after_step()
        state = bm.model_state_bytes(model, opt)
        extra = model.memory_stats() if lib.steps else {}
        del model, opt
    analysis = bm.Stopwatch()
    result = {
        "system": system,
        "world": world,
        "memory": {"peak_bytes": rec.peak_bytes, "resident_bytes": rec.resident_bytes},
        "at_peak": rec.live_at_peak(
            _category, [f"bench::{p}" for p in PHASES], regions=(*REGIONS, "bench::")
        ),
        "model_state": state,
        "build_s": build_s,
        "step_s": step_s,
        "losses": losses,
    }
    result["analysis_s"] = analysis.wall()
    if lib.steps:  # fsdp_lite's own accounting over the counted steps
        counted = lib.steps[1:] or lib.steps
        result["fsdp_lite"] = {
            k: max(s[k] for s in counted) for k in ("full_bytes_peak", "unsharded_units_peak")
        } | {"memory_stats": extra}
    return result


# -- what is live at the peak, by category -----------------------------------------------------


def _category(origin: list[str]) -> str:
    """A coarse bucket (a column of the breakdown table) for an allocation of this step."""
    text = " ".join(origin)
    return next((cat for key, cat in _RULES if key in text), "other")


# Origin substring -> category, first match wins.
_RULES = (
    ("Optimizer.", "optim"), ("bench::optimizer", "optim"), ("unshard", "gathered"),
    ("pre_backward", "gathered"), ("all_gather", "gathered"), ("pre_forward", "gathered"),
    ("post_backward", "grad RS"), ("finish_backward", "end-of-bwd"),
    ("root_post_backward", "end-of-bwd"), ("bench::backward", "bwd compute"),
    ("bench::forward", "fwd"),
)  # fmt: skip
CATEGORIES = ("resident", "gathered", "bwd compute", "grad RS", "end-of-bwd", "fwd", "optim",
              "other")  # fmt: skip


# -- the model's own figures (no system) ---------------------------------------------------------


def model_figures(cfg: ScaleConfig) -> dict[str, int]:
    """Ψ, the largest unit's parameters (root or block) and the activation bytes autograd
    saves for backward, from a forward of the unwrapped model on the meta device with its
    parameters in the compute dtype (saved parameters and views of them not counted)."""
    with torch.device("meta"):
        model = GPT(cfg.gpt_config()).to(COMPUTE_DTYPE)
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
        _, loss = model(x, x)
    activations = sum(t.numel() * t.element_size() for t in saved.values())
    del loss
    fig = {"num_params": psi, "block_params": block, "root_params": psi - cfg.layers * block}
    return fig | {"activation_bytes": activations}


# -- the table ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bm.make_parser(__doc__)
    p.add_argument("--worlds", default="8,64,512", help="comma-separated world sizes")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: %(default)s")
    names = [f.name for f in dataclasses.fields(ScaleConfig) if f.name not in ("seed", "lr")]
    bm.add_config_args(p, ScaleConfig(), names)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    bm.add_output_args(p, ROOT / "BENCHMARKS_scale.json")
    args = p.parse_args(argv)
    args.worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    args.systems = bm.pick(args.systems, SYSTEMS, "--systems")
    if min(args.worlds, default=0) < 1 or args.steps < 1:
        p.error("need world sizes >= 1 and --steps >= 1")
    return args


def summarize(r: dict[str, Any], fig: dict[str, int], ref: dict[str, Any] | None) -> dict:
    """The row's figures: peak, model state against 16Ψ/W, the rest, the bound."""
    world = r["world"]
    peak = r["memory"]["peak_bytes"]
    state = sum(r["model_state"].values())
    largest = max(fig["root_params"], fig["block_params"]) * COMPUTE_DTYPE.itemsize
    floor = 16 * fig["num_params"] / world
    bound = floor + 2 * largest + fig["activation_bytes"]
    return {
        "peak": peak,
        "vs_fsdp2": bm.ratio(peak, ref["memory"]["peak_bytes"] if ref else None, digits=3),
        "state": state,
        "floor": floor,
        "rest": peak - state,
        "bound": bound,
        "phase": r["at_peak"].get("phase", "?").removeprefix("bench::"),
        "phase_peaks": " / ".join(
            _gib(r["at_peak"].get("phase_peaks", {}).get(f"bench::{p}", 0)) for p in PHASES
        ),
        "step_s": min(r["step_s"][1:] or r["step_s"]),
    }


def _gib(x: float) -> str:
    return f"{x / bm.GIB:.2f}"


def main_table(results: list[dict[str, Any]], fig: dict[str, int]) -> list[str]:
    columns = (
        "W", "system", "peak GiB", "vs FSDP2", "model state GiB", "16Ψ/W GiB", "rest GiB",
        "bound GiB", "peak / bound", "peak in", "fwd / bwd / optim peaks GiB", "s/step",
    )  # fmt: skip
    rows = []
    ref = {r["world"]: r for r in results if r["system"] == "fsdp2"}
    for r in results:
        s = summarize(r, fig, ref.get(r["world"]))
        rows.append(
            [
                str(r["world"]), r["system"], _gib(s["peak"]), s["vs_fsdp2"], _gib(s["state"]),
                _gib(s["floor"]), _gib(s["rest"]), _gib(s["bound"]),
                f"{s['peak'] / s['bound']:.2f}", s["phase"], s["phase_peaks"],
                f"{s['step_s']:.1f}",
            ]
        )  # fmt: skip
    return bm.md_table(columns, rows, "rl" + "r" * 7 + "lrr")


def breakdown_table(results: list[dict[str, Any]]) -> list[str]:
    """What is live at the peak, by where it was allocated, and fsdp_lite's own figures."""
    rows = []
    for r in results:
        cats = r["at_peak"].get("categories", {})
        cells = [str(r["world"]), r["system"]]
        cells += [f"{cats[c] / bm.GIB:.3f}" if c in cats else "-" for c in CATEGORIES]
        lib = r.get("fsdp_lite")
        cells.append(
            f"full_bytes_peak {_gib(lib['full_bytes_peak'])} GiB, "
            f"unsharded_units_peak {lib['unsharded_units_peak']}, largest unit "
            f"{_gib(lib['memory_stats']['largest_unit_full_bytes'])} GiB"
            if lib
            else "-"
        )
        rows.append(cells)
    columns = ("W", "system", *CATEGORIES, "fsdp_lite.stats()")
    return bm.md_table(columns, rows, "rl" + "r" * len(CATEGORIES) + "l")


def origins_lines(results: list[dict[str, Any]], top: int = 6) -> list[str]:
    """The largest allocations live at each row's peak, by origin (outermost region first)."""
    lines = []
    for r in results:
        at = r["at_peak"]
        parts = [
            f"{o['origin'].removeprefix('bench::step > ')} {o['bytes'] / bm.GIB:.3f}"
            for o in at.get("origins", [])[:top]
        ]
        where = " > ".join(at.get("where", [])[1:]) or "?"
        lines.append(f"- W={r['world']} {r['system']}, peak in `{where}`; GiB: " + "; ".join(parts))
    return lines


def report(fig: dict[str, int], results: list, info: dict) -> str:
    cfg = info["config"]
    largest = max(fig["root_params"], fig["block_params"]) * COMPUTE_DTYPE.itemsize
    lines = [
        MARKERS[0],
        "## Scale: per-rank memory as W grows",
        "",
        f"Run {info['date']}, torch {torch.__version__}, commit {info['commit']}, "
        f"{info['runtime_s']:.0f} s for the whole table:",
        "",
        f"    {info['command']}",
        "",
        f"GPT {cfg['layers']} blocks, dim {cfg['dim']}, {cfg['heads']} heads, vocab "
        f"{cfg['vocab']} (tied), seq {cfg['seq']}, batch {cfg['batch']}/rank: Ψ = "
        f"{fig['num_params']:,}; units: the root ({fig['root_params']:,} params, "
        f"{largest / bm.GIB:.3f} GiB in bf16; its full gradient is as large in bf16 and twice "
        f"that in its fp32 reduce copy) and {cfg['layers']} blocks "
        f"({fig['block_params']:,} each). One rank on a fake process group per case, "
        f"bf16 compute, fp32 reduce, AdamW ({cfg['adamw']}); peak over steps 2.."
        f"{cfg['steps']} (profiler allocator events). Model state: shards + shard grads + "
        "AdamW state live after the last step; rest = peak - model state. Bound = 16Ψ/W + "
        f"2 x the largest unit's bf16 params ({2 * largest / bm.GIB:.3f} GiB) + activations "
        f"({fig['activation_bytes'] / bm.GIB:.3f} GiB: bytes autograd saves for backward in a "
        "forward of the unwrapped model, measured with saved_tensors_hooks on meta).",
        "",
        *main_table(results, fig),
        "",
        "Live at the peak, GiB, by where it was allocated: resident, before this step "
        "(shards, AdamW state; last step's grads are freed by zero_grad); gathered, in the "
        "gather hooks (full params); bwd compute, by autograd nodes (full-size grads, "
        "temporaries); grad RS, in the post-backward hooks (fp32 casts, reduce-scatter "
        "buffers, shard grads); fwd, in forward (activations); optim, in the optimizer step:",
        "",
        *breakdown_table(results),
        "",
        "Largest origins at each peak:",
        "",
        *origins_lines(results),
        MARKERS[1],
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = bm.config_from_args(ScaleConfig, args)
    watch = bm.Stopwatch()
    fig = model_figures(cfg)
    results = []
    for world in args.worlds:
        for system in args.systems:
            with bm.stage(f"[bench-scale] W={world} {system}"):
                # one rank, alone in its process: a fake process group is one per process
                r = bm.fake_rank(
                    run_case, 0, world, system, cfg, timeout_s=args.timeout, quiet=True
                )
            results.append(r)
    info = {
        "date": bm.now(),
        "command": bm.command_line("scripts/bench_scale.py", argv, python=None),
        "commit": bm.git_commit(),
        "config": dataclasses.asdict(cfg),
        "model": fig,
        "runtime_s": watch.wall(),
    }
    block = report(fig, results, info)
    print(f"[bench-scale] whole table: {info['runtime_s']:.0f} s")
    bm.publish(block, {"info": info, "results": results}, args, MARKERS, "bench-scale")


if __name__ == "__main__":
    main()
