"""Where fsdp_lite should lead FSDP2 on a GPU, measured (``gpu_check.py``'s parts
``hostbound`` and ``offload``; ``make gpu-measure``). On ``device`` (CUDA at W=1 NCCL, or
the CPU with gloo and tiny sizes in a dry run, whose figures mean nothing).

- ``host_bound_bench``: a deep, narrow Llama (48 blocks of width 512) whose step the host
  paces: tokens/s of fsdp_lite, FSDP2 and the unwrapped model, and each wrapper's host
  time per unit per step from the profiler (its own regions: hooks and the collectives
  they issue, not the model's ops), with the time per call of each region. A Chrome trace
  of one fsdp_lite step with Python stacks is written to ``$OUT`` when it is set.
- ``offload_bench``: the ~1.1B Llama with fsdp_lite's ``CPUOffload`` against FSDP2's
  ``CPUOffloadPolicy(pin_memory=True)``: s/step, the optimizer step's share, GPU peak.
- ``largest_offloaded``: Llama shapes (3B, then 7B) built on the meta device, each system
  training one step with CPU offload in a process of its own, inside a time budget.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from gpu_check_cases import GIB, _llama_config, _sync, _take_cublas_workspaces, target
from torch import nn

import fsdp_lite

SYSTEMS = ("fsdp_lite", "fsdp2", "unwrapped")
PREFIX = {"fsdp_lite": "fsdp_lite::", "fsdp2": "FSDP::"}  # each wrapper's profiler regions


def _config(name: str, dry: bool):
    """The Llama shapes measured here (HF ``LlamaConfig``); tiny ones in a dry run."""
    from transformers import LlamaConfig

    if dry:
        layers = 4 if name == "deep" else 2
        return LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            tie_word_embeddings=False,
        )  # fmt: skip
    shapes = {
        "deep": dict(vocab_size=8192, hidden_size=512, intermediate_size=1408,
                     num_hidden_layers=48, num_attention_heads=8, num_key_value_heads=8),
        "1B": None,  # TinyLlama-1.1B: gpu_check_cases._llama_config
        "3B": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                   num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8),
        "7B": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
    }  # fmt: skip
    if shapes[name] is None:
        return _llama_config(dry=False)
    return LlamaConfig(
        **shapes[name], max_position_embeddings=4096, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )  # fmt: skip


def build(
    system: str, cfg: Any, device: torch.device, offload: bool = False, meta: bool = False
) -> tuple[nn.Module, Callable[[], contextlib.AbstractContextManager]]:
    """One system's model (bf16 compute, fp32 reduce and masters; a unit per block, the
    embedding and the head) and the context its forward runs in (autocast for the
    unwrapped one). ``offload``: shards, grads and optimizer state in pinned host memory.
    ``meta``: built on the meta device and initialized after sharding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta" if meta else device):
        model = LlamaForCausalLM(cfg)
    if system == "unwrapped":
        autocast = contextlib.nullcontext
        if device.type == "cuda":
            autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
        return model, autocast
    if system == "fsdp_lite":
        layers = fsdp_lite.wrap.transformer_layers(model)
        policy = fsdp_lite.wrap.any_of(
            fsdp_lite.wrap.by_type(*layers), fsdp_lite.wrap.embeddings_and_head(model)
        )
        mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        wrapped = fsdp_lite.FSDPModule(
            model, auto_wrap_policy=policy, mixed_precision=mp, device=device,
            offload=fsdp_lite.CPUOffload(pin_memory=True) if offload else None,
        )  # fmt: skip
        return wrapped, contextlib.nullcontext
    mesh = init_device_mesh(device.type, (1,))
    kw: dict[str, Any] = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for module in (model.model.embed_tokens, *model.model.layers, model.lm_head):
        fully_shard(module, **kw)
    fully_shard(model, **kw)
    if meta:  # FSDP2 offloads from host memory: materialize there, buffers on the device
        model.to_empty(device="cpu" if offload else device)
        with torch.no_grad():
            model.apply(model._init_weights)
        rotary = model.model.rotary_emb
        with torch.device(device):  # a non-persistent buffer, computed at construction
            rotary.inv_freq = type(rotary)(cfg).inv_freq
    return model, contextlib.nullcontext


def _units(system: str, model: nn.Module) -> int:
    if system == "fsdp_lite":
        return len(fsdp_lite.core.tree.units_of(model))
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


class _Trainer:
    """One system's model, AdamW and batch; ``step`` is one training step."""

    def __init__(self, system: str, cfg: Any, device: torch.device, x: torch.Tensor,
                 offload: bool = False, meta: bool = False) -> None:  # fmt: skip
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        self.base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.system, self.device, self.x = system, device, x
        self.model, self.autocast = build(system, cfg, device, offload=offload, meta=meta)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def forward_backward(self) -> None:
        with self.autocast():
            loss = self.model(input_ids=self.x, labels=self.x).loss
        loss.backward()

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def step(self) -> None:
        self.forward_backward()
        self.optimizer_step()

    def timed(self, steps: int) -> float:
        """Seconds per step over ``steps`` steps, synchronized only at the ends."""
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        _sync(self.device)
        return (time.perf_counter() - t0) / steps

    def peak_bytes(self) -> int:
        if self.device.type != "cuda":
            return 0
        return torch.cuda.max_memory_allocated(self.device) - self.base

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


def _interleaved(
    systems: tuple[str, ...], rounds: int, run: Callable[[str], dict]
) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """``run(system)`` for every system, ``rounds`` times, each round starting one system
    later: per system, the list of its results; and per system that raised (not run again:
    the others go on, on one lent GPU run), its error's first line."""
    out: dict[str, list[dict]] = {s: [] for s in systems}
    failed: dict[str, str] = {}
    for r in range(rounds):
        for system in systems[r % len(systems) :] + systems[: r % len(systems)]:
            if system in failed:
                continue
            try:
                out[system].append(run(system))
            except Exception as exc:  # noqa: BLE001 - reported as FAIL; the others go on
                first = (str(exc).strip().splitlines() or [""])[0][:300]
                failed[system] = f"{type(exc).__name__}: {first}"
                out.pop(system)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return out, failed


def _failures(what: str, failed: dict[str, str]) -> Iterator[str]:
    for system, error in failed.items():
        yield f"FAIL {what}: {system} raised {error}"


def _judge(ok: Callable[[], bool], what: str, needs: tuple[str, ...], results: dict,
           dry: bool) -> str:  # fmt: skip
    """A target's line; not judged when a system it compares did not run."""
    missing = [s for s in needs if s not in results]
    if missing:
        return f"INFO target not judged ({', '.join(missing)} failed): {what}"
    return target(ok(), what, dry)


def _median(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def _params(results: dict[str, list[dict]]) -> int:
    """The model's parameter count, from any system that ran (0 if none did)."""
    return next(iter(results.values()))[0]["params"] if results else 0


# -- host-bound steps ------------------------------------------------------------------------


def _regions(prof: Any, prefix: str) -> tuple[float, dict[str, list[float]]]:
    """Seconds inside the outermost profiler regions named ``prefix...`` (the wrapper's
    host work: hooks and the collectives they issue), and each region's durations, nested
    ones included."""
    outer = 0
    calls: dict[str, list[float]] = {}

    def visit(nodes: list, inside: bool) -> None:
        nonlocal outer
        for n in nodes:
            mine = n.name.startswith(prefix)
            if mine:
                seconds = (n.end_time_ns - n.start_time_ns) / 1e9
                calls.setdefault(n.name.split(" (")[0], []).append(seconds)
                if not inside:
                    outer += n.end_time_ns - n.start_time_ns
            visit(n.children, inside or mine)

    visit(prof.profiler.kineto_results.experimental_event_tree(), False)
    return outer / 1e9, calls


def _host_profile(trainer: _Trainer, steps: int, trace: Path | None) -> dict:
    """The wrapper's host seconds per unit per step over ``steps`` profiled steps, and
    microseconds per call of each of its regions; ``trace``: also one step with Python
    stacks, as a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    from fsdp_lite.testing.memory import QuietProfile

    with QuietProfile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            trainer.step()
        _sync(trainer.device)
    outer, calls = _regions(prof, PREFIX[trainer.system])
    units = _units(trainer.system, trainer.model)
    per_call = {name: (len(ds) / steps, 1e6 * statistics.median(ds)) for name, ds in calls.items()}
    if trace is not None:
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as stacked:
            trainer.step()
            _sync(trainer.device)
        stacked.export_chrome_trace(str(trace))
    return {"host_per_unit_s": outer / steps / units, "units": units, "per_call": per_call}


def host_bound_bench(device: torch.device, dry: bool) -> Iterator[str]:
    cfg = _config("deep", dry)
    seq = 32 if dry else 512
    batches = (1,) if dry else (1, 4)
    warmup, steps, rounds = (1, 2, 1) if dry else (3, 10, 3)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    _take_cublas_workspaces(device)
    for batch in batches:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
        profiled: dict[str, dict] = {}  # per wrapper, its host profile (the first round's)

        def run(
            system: str, x: torch.Tensor = x, batch: int = batch, profiled: dict = profiled
        ) -> dict:
            t = _Trainer(system, cfg, device, x)
            for _ in range(warmup):
                t.step()
            t.reset_peak()
            result = {"s": t.timed(steps), "peak": t.peak_bytes(), "params": t.params}
            if system != "unwrapped" and "host" not in profiled.setdefault(system, {}):
                trace = None
                if out_dir is not None and system == "fsdp_lite":
                    trace = out_dir / f"hostbound_b{batch}_fsdp_lite_trace.json"
                profiled[system]["host"] = _host_profile(t, 2, trace)
            return result

        results, failed = _interleaved(SYSTEMS, rounds, run)
        yield from _failures(f"host-bound batch {batch}", failed)
        yield from _host_bound_table(cfg, seq, batch, steps, rounds, results, profiled, dry)


def _host_bound_table(
    cfg: Any, seq: int, batch: int, steps: int, rounds: int, results: dict, profiled: dict,
    dry: bool,
) -> Iterator[str]:  # fmt: skip
    tokens = seq * batch
    step = {s: _median(r, "s") for s, r in results.items()}
    rate = {s: tokens / t for s, t in step.items()}
    host = {s: p["host"] for s, p in profiled.items() if "host" in p and s in results}
    params = _params(results)
    yield (f"INFO host-bound: Llama {params / 1e6:.0f}M params ({cfg.num_hidden_layers} "
           f"blocks of width {cfg.hidden_size}), seq {seq} x batch {batch}, bf16 compute, "
           f"fp32 reduce, AdamW, W=1; median of {rounds} interleaved rounds of {steps} "
           f"steps; host per unit: the wrapper's outermost profiler regions per step / "
           f"its units")  # fmt: skip
    yield "| system | s/step | tokens/s | vs FSDP2 | vs unwrapped | host ms/unit/step | peak GiB |"
    yield "|---|---:|---:|---:|---:|---:|---:|"
    for s in results:
        h = "-"
        if s in host:
            h = f"{1e3 * host[s]['host_per_unit_s']:.3f} ({host[s]['units']} units)"
        peak = max(r["peak"] for r in results[s])
        mem = f"{peak / GIB:.2f}" if peak else "-"
        vs = {ref: f"{rate[s] / rate[ref]:.2f}x" if ref in rate else "-" for ref in SYSTEMS}
        yield (f"| {s} | {step[s]:.4f} | {rate[s]:,.0f} | {vs['fsdp2']} | {vs['unwrapped']} | "
               f"{h} | {mem} |")  # fmt: skip
    for s, h in host.items():
        calls = sorted(h["per_call"].items(), key=lambda kv: -kv[1][1])
        text = ", ".join(f"{name} {n:.0f}/step {us:.0f} us" for name, (n, us) in calls[:8])
        yield f"INFO batch {batch} {s} regions (calls per step, median per call): {text}"
    both = ("fsdp_lite", "fsdp2", "unwrapped")
    if all(s in step for s in both) and step["fsdp2"] <= 1.15 * step["unwrapped"]:
        yield f"INFO batch {batch}: FSDP2 is within 1.15x of the unwrapped step (not host-bound)"
    else:
        yield _judge(lambda: rate["fsdp_lite"] >= 1.15 * rate["fsdp2"],
                     f"batch {batch}: fsdp_lite tokens/s >= 1.15x FSDP2's (FSDP2 host-bound)",
                     both, results, dry)  # fmt: skip
    yield _judge(lambda: rate["fsdp_lite"] >= 0.95 * rate["unwrapped"],
                 f"batch {batch}: fsdp_lite tokens/s >= 0.95x unwrapped",
                 ("fsdp_lite", "unwrapped"), results, dry)  # fmt: skip
    yield _judge(lambda: host["fsdp_lite"]["host_per_unit_s"]
                 <= 0.3 * host["fsdp2"]["host_per_unit_s"],
                 f"batch {batch}: fsdp_lite host per unit <= 0.3x FSDP2's",
                 ("fsdp_lite", "fsdp2"), host, dry)  # fmt: skip


# -- CPU offload -----------------------------------------------------------------------------


def offload_bench(device: torch.device, dry: bool) -> Iterator[str]:
    cfg = _config("1B", dry)
    seq, batch = (64, 2) if dry else (2048, 2)
    warmup, steps, rounds = (1, 2, 1) if dry else (2, 3, 2)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
    _take_cublas_workspaces(device)

    def run(system: str) -> dict:
        t = _Trainer(system, cfg, device, x, offload=True)
        for _ in range(warmup):
            t.step()
        t.reset_peak()
        fb = opt = 0.0
        for _ in range(steps):  # synchronized between phases: the optimizer step's share
            _sync(device)
            t0 = time.perf_counter()
            t.forward_backward()
            _sync(device)
            t1 = time.perf_counter()
            t.optimizer_step()
            _sync(device)
            fb, opt = fb + t1 - t0, opt + time.perf_counter() - t1
        return {"s": (fb + opt) / steps, "opt_share": opt / (fb + opt), "peak": t.peak_bytes(),
                "params": t.params}  # fmt: skip

    results, failed = _interleaved(("fsdp_lite", "fsdp2"), rounds, run)
    yield from _failures("offload", failed)
    params = _params(results)
    yield (f"INFO CPU offload: Llama {params / 1e9:.2f}B params, seq {seq} x batch {batch}, "
           f"bf16 compute, fp32 reduce, AdamW on the host, W=1; fsdp_lite CPUOffload against "
           f"FSDP2 CPUOffloadPolicy(pin_memory=True); median of {rounds} interleaved rounds "
           f"of {steps} steps, synchronized between forward+backward and the optimizer "
           f"step")  # fmt: skip
    yield "| system | s/step | optimizer step share | GPU peak GiB |"
    yield "|---|---:|---:|---:|"
    step = {s: _median(r, "s") for s, r in results.items()}
    peak = {s: max(x["peak"] for x in r) for s, r in results.items()}
    for s, r in results.items():
        mem = f"{peak[s] / GIB:.2f}" if peak[s] else "-"
        yield f"| {s} | {step[s]:.3f} | {_median(r, 'opt_share'):.0%} | {mem} |"
    both = ("fsdp_lite", "fsdp2")
    yield _judge(lambda: step["fsdp_lite"] <= step["fsdp2"], "offload: fsdp_lite s/step <= FSDP2's",
                 both, results, dry)  # fmt: skip
    yield _judge(lambda: peak["fsdp_lite"] <= peak["fsdp2"],
                 "offload: fsdp_lite GPU peak <= FSDP2's", both, results, dry)  # fmt: skip


def largest_offloaded(device: torch.device, dry: bool, budget_s: float) -> Iterator[str]:
    """Each (size, system) trains one step with CPU offload in a process of its own (a
    host out of memory kills only it), smallest first, while the budget lasts."""
    seq = 64 if dry else 2048
    yield (f"INFO largest with CPU offload: Llama shapes built on the meta device, seq {seq} "
           f"x batch 1, one step (including its first-step allocations), W=1; one process "
           f"per case, {budget_s:.0f} s for all")  # fmt: skip
    yield "| size | system | params | s/step | GPU peak GiB | host peak RSS GiB | result |"
    yield "|---|---|---:|---:|---:|---:|---|"
    deadline = time.monotonic() + budget_s
    for size in ("3B",) if dry else ("3B", "7B"):  # a dry run checks one of each
        for system in ("fsdp_lite", "fsdp2"):
            left = deadline - time.monotonic()
            if left < 10:
                yield f"| {size} | {system} | | | | | not reached: out of budget |"
                continue
            cmd = [sys.executable, __file__, "fit", system, size, str(device), str(seq)]
            if dry:
                cmd.append("--dry")
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
            except subprocess.TimeoutExpired:
                yield f"| {size} | {system} | | | | | stopped at the budget's end |"
                continue
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
                yield f"| {size} | {system} | | | | | failed: {why[:200]} |"
                continue
            r = json.loads(lines[-1])
            yield (f"| {size} | {system} | {r['params'] / 1e9:.2f}B | {r['s']:.1f} | "
                   f"{r['peak'] / GIB:.2f} | {r['rss'] / GIB:.1f} | trained |")  # fmt: skip


def _fit(system: str, size: str, device_name: str, seq: int, dry: bool) -> None:
    """One step of ``system`` on ``size`` with CPU offload, in this process (one rank)."""
    import resource
    import tempfile

    import torch.distributed as dist

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            cfg = _config(size, dry)
            x = torch.randint(0, cfg.vocab_size, (1, seq)).to(device)
            t = _Trainer(system, cfg, device, x, offload=True, meta=True)
            seconds = t.timed(1)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            print(json.dumps({"s": seconds, "peak": t.peak_bytes(), "params": t.params,
                              "rss": rss}), flush=True)  # fmt: skip
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":  # one case of largest_offloaded
    if sys.argv[1] == "fit":
        _fit(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), "--dry" in sys.argv)
