"""Scale table (issue 17): per-rank memory of fsdp_lite and FSDP2 as W grows.

    PYTHONPATH=.:scripts .venv/bin/python scripts/bench_scale.py [--worlds 8,64,512]
        [--systems fsdp_lite,fsdp2] [--layers 24 --dim 2048 --heads 16 --vocab 50304]
        [--seq 128 --batch 1] [--steps 3] [--no-write]

Every (W, system) case runs one rank in its own subprocess on a fake process group
(collectives are no-ops that copy the local shard into every chunk): what rank 0 of a real
job holds. The model is built on meta and materialized unit by unit by the system itself
(fsdp_lite's deferred init, FSDP2's ``to_empty``); shards are filled N(0, 0.02) locally.
bf16 compute, fp32 reduce, a unit per block plus the root, AdamW (``--adamw``: foreach,
CUDA's default; loop, CPU's; fused). Peak tensor memory per rank from the profiler's
allocator events (``bench_measure.peak_from_profile``) over the steps after the first,
which allocates the optimizer state; what is live at the peak is attributed to the region
that allocated it. Writes a table between the ``bench-scale`` markers of BENCHMARKS.md
and the raw figures to BENCHMARKS_scale.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench import write_markdown  # noqa: E402
from bench_measure import missed_free, peak_from_profile, walk  # noqa: E402
from bench_systems import tied_gpt_config  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import fsdp_lite  # noqa: E402
from fsdp_lite.testing.models import GPT, Block, GPTConfig  # noqa: E402

BEGIN, END = "<!-- bench-scale:start -->", "<!-- bench-scale:end -->"
SYSTEMS = ("fsdp_lite", "fsdp2")
GIB = 2**30
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
        from fsdp_lite.core.deferred_init import no_init

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


def run_case(system: str, world: int, cfg: ScaleConfig) -> dict[str, Any]:
    """One rank of a ``world``-rank job: build, train ``cfg.steps`` steps under the profiler."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        g = torch.Generator().manual_seed(cfg.seed)
        tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
        batch = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        lib = system == "fsdp_lite"
        t0 = time.perf_counter()
        step_s, losses, lib_steps = [], [], []
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model = build(system, cfg, world)
            build_s = time.perf_counter() - t0
            opt = make_optimizer(model, cfg)
            for _ in range(cfg.steps):
                if lib:
                    fsdp_lite.reset_stats()
                t = time.perf_counter()
                with record_function("bench::step"):
                    losses.append(train_step(model, opt, batch))
                step_s.append(time.perf_counter() - t)
                if lib:
                    lib_steps.append(fsdp_lite.stats())
            state = model_state_bytes(model, opt)
            extra = model.memory_stats() if lib else {}
            del model, opt
        t = time.perf_counter()
        cpu = torch.device("cpu")
        result = {
            "system": system,
            "world": world,
            "memory": peak_from_profile(prof, cpu),
            "at_peak": live_at_peak(prof, cpu),
            "model_state": state,
            "build_s": build_s,
            "step_s": step_s,
            "losses": losses,
        }
        result["analysis_s"] = time.perf_counter() - t
        if lib:  # fsdp_lite's own accounting over the counted steps
            counted = lib_steps[1:] or lib_steps
            result["fsdp_lite"] = {
                k: max(s[k] for s in counted) for k in ("full_bytes_peak", "unsharded_units_peak")
            } | {"memory_stats": extra}
        return result
    finally:
        dist.destroy_process_group()


def model_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's shards, shard grads and optimizer state (storage, deduplicated)."""
    seen: set[int] = set()

    def nbytes(tensors: Iterator[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            t = t.to_local() if hasattr(t, "to_local") else t
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total

    params = list(model.parameters())
    return {
        "params": nbytes(iter(params)),
        "grads": nbytes(p.grad for p in params if p.grad is not None),
        "optimizer": nbytes(
            v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
        ),
    }


# -- what is live at the peak -------------------------------------------------------------------

_ANNOTATIONS = ("fsdp_lite::", "FSDP::", "Optimizer.", "bench::")
_AUTOGRAD = "autograd::engine::evaluate_function: "


def _origin(node: Any) -> list[str]:
    """The allocation's context, outermost first: profiler regions, the autograd node that
    ran, and the outermost aten op below the innermost of those."""
    chain = []
    p = node.parent
    while p is not None:
        chain.append(p.name)
        p = p.parent
    chain.reverse()
    kept: list[str] = []
    op = None
    for name in chain:
        if name.startswith(_ANNOTATIONS) or name.startswith(_AUTOGRAD):
            kept.append(name.removeprefix(_AUTOGRAD))
            op = None
        elif op is None and name.startswith("aten::"):
            op = name
    return kept + ([op] if op else [])


def _events(nodes: list, device: torch.device, steps: list) -> list[tuple[int, int, Any]]:
    """(time, +-bytes, allocation node), as ``bench_measure._memory_deltas`` counts them."""
    allocs = sorted(
        (n for n in nodes if n.tag == torch._C._profiler._EventType.Allocation),
        key=lambda n: n.start_time_ns,
    )
    live: dict[int, Any] = {}
    events: list[tuple[int, int, Any]] = []
    for n in allocs:
        f = n.extra_fields
        if f.device.type != device.type:
            continue
        if f.alloc_size > 0:
            if f.ptr in live:
                old = live.pop(f.ptr)
                events.append((*missed_free(old, n.start_time_ns, steps), old))
            live[f.ptr] = n
            events.append((n.start_time_ns, f.alloc_size, n))
        elif (old := live.pop(f.ptr, None)) is not None:
            events.append((n.start_time_ns, f.alloc_size, old))
    events += [(*missed_free(n, 2**63, steps), n) for n in live.values()]
    events.sort(key=lambda e: (e[0], e[1]))
    return events


def live_at_peak(prof: profile, device: torch.device, top: int = 25) -> dict[str, Any]:
    """When the peak of the counted steps happens, what is live then (by origin), and the
    peak of each phase (forward, backward, optimizer step)."""
    nodes = list(walk(prof.profiler.kineto_results.experimental_event_tree()))
    steps = sorted((n.start_time_ns, n.end_time_ns) for n in nodes if n.name == "bench::step")
    windows = steps[1:] or steps
    events = _events(nodes, device, steps)
    phases = [
        (n.start_time_ns, n.end_time_ns, n.name.removeprefix("bench::"))
        for n in nodes
        if n.name in {f"bench::{p}" for p in PHASES} and n.start_time_ns >= windows[0][0]
    ]
    peak_i, phase_peaks = _sweep(events, windows, phases)
    if peak_i < 0:
        return {}
    t_peak = events[peak_i][0]
    step_start = max(a for a, _ in steps if a <= t_peak)
    alive: dict[int, Any] = {}
    for _, delta, n in events[: peak_i + 1]:
        if delta > 0:
            alive[id(n)] = n
        else:
            alive.pop(id(n), None)
    groups: dict[str, int] = defaultdict(int)
    cats: dict[str, int] = defaultdict(int)
    for n in alive.values():
        size = n.extra_fields.alloc_size
        if n.start_time_ns < step_start:
            key, cat = "allocated before this step", "resident"
        else:
            origin = _origin(n)
            key, cat = " > ".join(origin), _category(origin)
        groups[key] += size
        cats[cat] += size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    return {
        "peak_bytes": sum(cats.values()),
        "phase": next((name for a, b, name in phases if a <= t_peak <= b), "step"),
        "phase_peaks": phase_peaks,
        "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        "origins": [{"origin": k, "bytes": v} for k, v in ranked[:top]],
        "where": _where(nodes, t_peak),
    }


def _sweep(events: list, windows: list, phases: list) -> tuple[int, dict[str, int]]:
    """Index of the event at the peak inside ``windows``, and the peak inside each phase."""
    live = peak = 0
    peak_i = -1
    phase_peaks: dict[str, int] = defaultdict(int)
    for i, (t, delta, _) in enumerate(events):
        live += delta
        if not any(a <= t <= b for a, b in windows):
            continue
        if live > peak:
            peak, peak_i = live, i
        for a, b, name in phases:
            if a <= t <= b:
                phase_peaks[name] = max(phase_peaks[name], live)
    return peak_i, dict(phase_peaks)


def _where(nodes: list, t: int) -> list[str]:
    """The regions (and autograd nodes) open at time ``t``, outermost first."""
    open_ = [
        n
        for n in nodes
        if n.start_time_ns <= t <= n.end_time_ns
        and (n.name.startswith(_ANNOTATIONS) or n.name.startswith(_AUTOGRAD))
    ]
    open_.sort(key=lambda n: n.start_time_ns)
    return [n.name.removeprefix(_AUTOGRAD) for n in open_]


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
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worlds", default="8,64,512", help="comma-separated world sizes")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: %(default)s")
    for name, default in dataclasses.asdict(ScaleConfig()).items():
        if name not in ("seed", "lr"):
            p.add_argument(f"--{name}", type=type(default), default=default)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    p.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    p.add_argument("--json", type=Path, default=ROOT / "BENCHMARKS_scale.json")
    p.add_argument("--no-write", action="store_true", help="print the table, write nothing")
    args = p.parse_args(argv)
    args.worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if bad := [s for s in args.systems if s not in SYSTEMS]:
        p.error(f"--systems: unknown {bad}; choose from {', '.join(SYSTEMS)}")
    if min(args.worlds, default=0) < 1 or args.steps < 1:
        p.error("need world sizes >= 1 and --steps >= 1")
    return args


def spawn_case(system: str, world: int, cfg: ScaleConfig, timeout: float) -> dict[str, Any]:
    """``run_case`` in a fresh interpreter (a fake process group is one per process)."""
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        out = Path(tmp, "result.json")
        cmd = [sys.executable, __file__, "--child", system, str(world)]
        cmd += [json.dumps(dataclasses.asdict(cfg)), str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, timeout=timeout, env=env, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


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
        "vs_fsdp2": peak / ref["memory"]["peak_bytes"] if ref else None,
        "state": state,
        "floor": floor,
        "rest": peak - state,
        "bound": bound,
        "phase": r["at_peak"].get("phase", "?"),
        "phase_peaks": " / ".join(
            _gib(r["at_peak"].get("phase_peaks", {}).get(p, 0)) for p in PHASES
        ),
        "step_s": min(r["step_s"][1:] or r["step_s"]),
    }


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def main_table(results: list[dict[str, Any]], fig: dict[str, int]) -> list[str]:
    head = (
        "| W | system | peak GiB | vs FSDP2 | model state GiB | 16Ψ/W GiB | rest GiB "
        "| bound GiB | peak / bound | peak in | fwd / bwd / optim peaks GiB | s/step |"
    )
    rows = [head, "|---:|---|" + "---:|" * 7 + "---|---:|---:|"]
    ref = {r["world"]: r for r in results if r["system"] == "fsdp2"}
    for r in results:
        s = summarize(r, fig, ref.get(r["world"]))
        vs = f"{s['vs_fsdp2']:.3f}x" if s["vs_fsdp2"] else "-"
        cells = [
            str(r["world"]), r["system"], _gib(s["peak"]), vs, _gib(s["state"]),
            _gib(s["floor"]), _gib(s["rest"]), _gib(s["bound"]),
            f"{s['peak'] / s['bound']:.2f}", s["phase"], s["phase_peaks"], f"{s['step_s']:.1f}",
        ]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def breakdown_table(results: list[dict[str, Any]]) -> list[str]:
    """What is live at the peak, by where it was allocated, and fsdp_lite's own figures."""
    head = "| W | system | " + " | ".join(CATEGORIES) + " | fsdp_lite.stats() |"
    rows = [head, "|---:|---|" + "---:|" * len(CATEGORIES) + "---|"]
    for r in results:
        cats = r["at_peak"].get("categories", {})
        cells = [str(r["world"]), r["system"]]
        cells += [f"{cats[c] / GIB:.3f}" if c in cats else "-" for c in CATEGORIES]
        lib = r.get("fsdp_lite")
        cells.append(
            f"full_bytes_peak {_gib(lib['full_bytes_peak'])} GiB, "
            f"unsharded_units_peak {lib['unsharded_units_peak']}, largest unit "
            f"{_gib(lib['memory_stats']['largest_unit_full_bytes'])} GiB"
            if lib
            else "-"
        )
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def origins_lines(results: list[dict[str, Any]], top: int = 6) -> list[str]:
    """The largest allocations live at each row's peak, by origin (outermost region first)."""
    lines = []
    for r in results:
        at = r["at_peak"]
        parts = [
            f"{o['origin'].removeprefix('bench::step > ')} {o['bytes'] / GIB:.3f}"
            for o in at.get("origins", [])[:top]
        ]
        where = " > ".join(at.get("where", [])[1:]) or "?"
        lines.append(f"- W={r['world']} {r['system']}, peak in `{where}`; GiB: " + "; ".join(parts))
    return lines


def report(fig: dict[str, int], results: list, info: dict) -> str:
    cfg = info["config"]
    largest = max(fig["root_params"], fig["block_params"]) * COMPUTE_DTYPE.itemsize
    lines = [
        BEGIN,
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
        f"{largest / GIB:.3f} GiB in bf16; its full gradient is as large in bf16 and twice "
        f"that in its fp32 reduce copy) and {cfg['layers']} blocks "
        f"({fig['block_params']:,} each). One rank on a fake process group per case, "
        f"bf16 compute, fp32 reduce, AdamW ({cfg['adamw']}); peak over steps 2.."
        f"{cfg['steps']} (profiler allocator events). Model state: shards + shard grads + "
        "AdamW state live after the last step; rest = peak - model state. Bound = 16Ψ/W + "
        f"2 x the largest unit's bf16 params ({2 * largest / GIB:.3f} GiB) + activations "
        f"({fig['activation_bytes'] / GIB:.3f} GiB: bytes autograd saves for backward in a "
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
        END,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    names = {f.name for f in dataclasses.fields(ScaleConfig)}
    cfg = ScaleConfig(**{k: v for k, v in vars(args).items() if k in names})
    t0 = time.perf_counter()
    fig = model_figures(cfg)
    results = []
    for world in args.worlds:
        for system in args.systems:
            t = time.perf_counter()
            r = spawn_case(system, world, cfg, args.timeout)
            results.append(r)
            took = f"{time.perf_counter() - t:.0f} s"
            print(f"[bench-scale] W={world} {system}: {took}", flush=True)
    git = ["git", "rev-parse", "--short", "HEAD"]
    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["scripts/bench_scale.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": subprocess.run(git, cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "config": dataclasses.asdict(cfg),
        "model": fig,
        "runtime_s": time.perf_counter() - t0,
    }
    block = report(fig, results, info)
    print(block)
    print(f"[bench-scale] whole table: {info['runtime_s']:.0f} s")
    if not args.no_write:
        write_markdown(args.out, block, BEGIN, END)
        args.json.write_text(json.dumps({"info": info, "results": results}, indent=1))
        print(f"[bench-scale] wrote {args.out} and {args.json}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        system, world, cfg_json, out = sys.argv[2:]
        result = run_case(system, int(world), ScaleConfig(**json.loads(cfg_json)))
        Path(out).write_text(json.dumps(result))
    else:
        main()
