"""The memory planner against measured peaks.

``estimate_memory`` promises one rank's peak tensor memory over a steady-state step within
10% of what the step really allocates. Each configuration below is trained for three steps
under torch's fake process group (collectives are no-ops, so one process is one rank of a
W-rank run) with AdamW, its allocations recorded by the profiler
(``fsdp_lite.testing.memory.MemoryRecorder``), and its peak over steps 2 and 3 compared with
the estimate for a fresh meta-device copy of the model. A fake process group can be set up
once per process, so each world size runs in its own subprocess (this file, run as a script).

The compute device is the CPU here, so offloaded shards, grads and optimizer state live in
the memory measured, and the estimate counts them (see ``fsdp_lite.planner.estimate``).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import pytest
import torch

import fsdp_lite
from fsdp_lite.addons.activation_checkpointing import CheckpointWrapper
from fsdp_lite.build import ownership
from fsdp_lite.planner.estimate import default_loss
from fsdp_lite.testing.memory import MemoryRecorder
from fsdp_lite.testing.models import GPT, Block, GPTConfig

TOLERANCE = 0.10
GPT_SIZES = dict(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=256)
LLAMA_SIZES = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2000,
    max_position_embeddings=128,
    use_cache=False,
)


@dataclass(frozen=True)
class Case:
    world: int
    model: str  # "gpt" or "llama"
    # "fp32", "bf16" (MixedPrecision(param_dtype=torch.bfloat16)) or "bf16/bf16" (and
    # reduce_dtype=torch.bfloat16: gradients reduced in bf16, then copied to fp32 shard grads)
    precision: str = "fp32"
    ac: bool = False  # activation checkpointing of every block
    offload: bool = False  # CPUOffload()
    reshard_after_forward: bool | None = None
    prefetch: int | None = 2  # PrefetchPolicy.max_in_flight; None: no prefetching
    batch: tuple[int, int] = (2, 64)  # (micro-batch, sequence length)
    ends: bool = False  # the embedding and the head as units of their own
    # optimizer_params="whole": estimated for the rank owning the most, which is rank 0 (the
    # largest parameter's) in these cases: the rank a fake-PG worker measures.
    whole: bool = False
    # A step of MICRO micro-batches, those before the last run as estimate_memory's
    # grad_accumulation says ("sync", "no_sync", "keep"); None: one micro-batch a step.
    accumulate: str | None = None

    @property
    def name(self) -> str:
        parts = [f"W={self.world}", self.model, self.precision, f"B,T={self.batch}"]
        parts += ["AC"] * self.ac + ["offload"] * self.offload
        if self.reshard_after_forward is not None:
            parts.append(f"reshard_after_forward={self.reshard_after_forward}")
        if self.prefetch != 2:
            parts.append(f"prefetch={self.prefetch}")
        parts += ["embedding and head units"] * self.ends + ["whole params"] * self.whole
        if self.accumulate:
            parts.append(f"{MICRO} micro-batches {self.accumulate}")
        return " ".join(parts)


ALL_CASES = [
    Case(1, "gpt", "bf16", batch=(1, 8)),  # the optimizer step is the peak
    Case(2, "gpt"),
    Case(2, "gpt", "bf16", ac=True),
    Case(2, "llama", offload=True),
    Case(2, "gpt", batch=(1, 8), reshard_after_forward=False),
    Case(2, "gpt", "bf16/bf16", batch=(1, 8)),  # the end of backward is the peak
    Case(8, "gpt", "bf16"),
    Case(8, "gpt", ac=True, offload=True),
    Case(8, "llama", "bf16", ac=True),
    Case(8, "gpt", prefetch=None, reshard_after_forward=True),
    Case(8, "llama", "bf16", ends=True),
    Case(2, "gpt", whole=True),
    Case(8, "gpt", "bf16", whole=True),
    Case(8, "llama", "bf16", ends=True, whole=True),
    Case(64, "llama", "bf16", ends=True),
    Case(64, "gpt", ac=True),
    Case(64, "llama"),
    Case(64, "gpt", "bf16", offload=True),
    Case(64, "llama", "bf16", reshard_after_forward=True, prefetch=1),
    Case(2, "gpt", "bf16", accumulate="keep"),
    Case(8, "gpt", accumulate="no_sync"),
    Case(8, "gpt", "bf16", accumulate="keep", reshard_after_forward=True),
    Case(8, "gpt", accumulate="sync"),
]
MICRO = 3
HAS_HF = importlib.util.find_spec("transformers") is not None
CASES = [c for c in ALL_CASES if HAS_HF or c.model != "llama"]


# -- one world size, in its own process --------------------------------------------------


def _policy(case: Case, model: torch.nn.Module, block: type) -> fsdp_lite.wrap.Policy:
    policy = fsdp_lite.wrap.by_type(block)
    if case.ends:
        policy = fsdp_lite.wrap.any_of(policy, fsdp_lite.wrap.embeddings_and_head(model))
    return policy


def _build(case: Case) -> tuple[torch.nn.Module, type]:
    with torch.device("meta"):
        if case.model == "gpt":
            return GPT(GPTConfig(**GPT_SIZES)), Block
        import transformers
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        torch.manual_seed(0)
        config = transformers.LlamaConfig(**LLAMA_SIZES)
        return transformers.LlamaForCausalLM(config), LlamaDecoderLayer


def _batch(case: Case) -> torch.Tensor:
    vocab = GPT_SIZES["vocab_size"] if case.model == "gpt" else LLAMA_SIZES["vocab_size"]
    return torch.randint(0, vocab, case.batch)


def _settings(case: Case) -> dict:
    mp = None
    if case.precision != "fp32":
        reduce = torch.bfloat16 if case.precision == "bf16/bf16" else torch.float32
        mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    return {
        "mixed_precision": mp,
        "offload": fsdp_lite.CPUOffload() if case.offload else None,
        "reshard_after_forward": case.reshard_after_forward,
        "whole_params": case.whole,
        "prefetch": None
        if case.prefetch is None
        else fsdp_lite.PrefetchPolicy(max_in_flight=case.prefetch),
    }


def _train(model: torch.nn.Module, case: Case, rec: MemoryRecorder) -> None:
    # Deferred init leaves each module's recorded RNG state in reference cycles: collected
    # here, as any later collection would, so they do not blur the step's peak.
    gc.collect()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro = MICRO if case.accumulate else 1
    for _ in range(3):
        with rec.step():
            for i in range(micro):
                last = i == micro - 1
                model.set_requires_gradient_sync(last or case.accumulate == "sync")
                model.set_reshard_after_backward(last or case.accumulate != "keep")
                loss = default_loss(model(_batch(case)))
                loss.backward()
                del loss
            opt.step()
            opt.zero_grad()


def measure(case: Case) -> int:
    """Train ``case`` as ``scripts/train.py`` wraps models (checkpointing first, then a unit
    per checkpointed block) and return its measured steady-state peak."""
    ownership.forget_owned()  # whole params: balanced as the process's first model
    with MemoryRecorder("cpu") as rec:
        model, block = _build(case)
        policy = _policy(case, model, block)
        if case.ac:
            fsdp_lite.apply_activation_checkpointing(model, fsdp_lite.wrap.by_type(block))
            policy = fsdp_lite.wrap.by_type(CheckpointWrapper)
        model = fsdp_lite.FSDPModule(model, auto_wrap_policy=policy, **_settings(case))
        _train(model, case, rec)
    return rec.peak_bytes


def estimate(case: Case) -> fsdp_lite.planner.estimate.MemoryEstimate:
    model, block = _build(case)
    return fsdp_lite.estimate_memory(
        model,
        (_batch(case),),
        case.world,
        auto_wrap_policy=_policy(case, model, block),
        activation_checkpointing=case.ac,
        backend="fake",
        grad_accumulation=case.accumulate,
        **_settings(case),
    )


def _plan_row(world: int) -> dict:
    """``plan`` under a budget the default settings miss: the plan it returns, wrapped with
    ``Plan.wrap`` and trained, measures within the tolerance of its estimate."""
    case = Case(world, "gpt")
    model, block = _build(case)
    kwargs = dict(auto_wrap_policy=fsdp_lite.wrap.by_type(block), backend="fake")
    default = fsdp_lite.estimate_memory(model, (_batch(case),), world, **kwargs)
    budget = int(default.peak_bytes * 0.85)
    chosen = fsdp_lite.plan(model, (_batch(case),), world, budget, **kwargs)
    with MemoryRecorder("cpu") as rec:
        wrapped = chosen.wrap(_build(case)[0])
        _train(wrapped, case, rec)
    name = (
        f"W={world} gpt plan(budget={budget / 2**20:.1f} MiB): "
        f"AC={chosen.activation_checkpointing} "
        f"reshard_after_forward={chosen.reshard_after_forward} "
        f"prefetch={chosen.prefetch and chosen.prefetch.max_in_flight}"
    )
    return _row(name, chosen.estimate, rec.peak_bytes, budget=budget)


def _row(
    name: str, est: fsdp_lite.planner.estimate.MemoryEstimate, measured: int, **extra: object
) -> dict:
    return {
        "name": name,
        "estimate": est.peak_bytes,
        "measured": measured,
        "breakdown": est.breakdown,
        "phase": est.phase,
        **extra,
    }


def worker(world: int) -> None:
    """Run this world size's cases; one JSON line per case on stdout."""
    from fsdp_lite.testing.spawn import fake_group

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with fake_group(0, world):
        for case in (c for c in CASES if c.world == world):
            est = estimate(case)
            print(json.dumps(_row(case.name, est, measure(case), case=asdict(case))), flush=True)
        if world == 8:
            print(json.dumps(_plan_row(world)), flush=True)


# -- the test ----------------------------------------------------------------------------


def _run_workers(worlds: list[int]) -> list[dict]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(w)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for w in worlds
    ]
    rows = []
    for w, p in zip(worlds, procs, strict=True):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"W={w} worker failed:\n{err[-4000:]}"
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows


def _table(rows: list[dict]) -> str:
    head = f"{'configuration':<72}{'estimate':>16}{'measured':>16}{'error':>9}  peak at"
    lines = [head]
    for r in rows:
        err = 100 * (r["estimate"] / r["measured"] - 1)
        lines.append(
            f"{r['name']:<72}{r['estimate']:>16,}{r['measured']:>16,}{err:>+8.2f}%  {r['phase']}"
        )
    return "\n".join(lines)


def test_estimates_within_ten_percent_of_measured_peaks(capsys: pytest.CaptureFixture) -> None:
    t0 = time.monotonic()
    rows = _run_workers(sorted({c.world for c in CASES}))
    with capsys.disabled():
        print(f"\nmemory planner vs measured peaks ({time.monotonic() - t0:.1f} s)")
        print(_table(rows))
    assert len(rows) == len(CASES) + 1, [r["name"] for r in rows]
    for r in rows:
        assert sum(r["breakdown"].values()) == r["estimate"], r
        error = abs(r["estimate"] / r["measured"] - 1)
        assert error <= TOLERANCE, (
            f"{r['name']}: estimate {r['estimate']} vs measured {r['measured']} "
            f"({100 * error:.1f}% off); breakdown {r['breakdown']}"
        )
    (plan_row,) = [r for r in rows if "budget" in r]
    assert plan_row["estimate"] <= plan_row["budget"]


# -- without a process group ----------------------------------------------------------------


def _small_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def _snapshot(model: torch.nn.Module) -> list:
    return [
        (
            name,
            [(k, id(p), p is not None and p.data_ptr()) for k, p in m._parameters.items()],
            [(k, id(b)) for k, b in m._buffers.items()],
            len(m._forward_hooks) + len(m._forward_pre_hooks),
            "forward" in m.__dict__,
        )
        for name, m in model.named_modules()
    ]


def test_estimate_leaves_the_model_as_it_was() -> None:
    """A real model: parameters, buffers, hooks and forward are restored after the trace
    (checkpointing and mixed precision included), the model still trains, and its estimate
    equals that of the same model built on the meta device."""
    model = _small_gpt()
    before = _snapshot(model)
    kwargs = dict(
        auto_wrap_policy=fsdp_lite.wrap.by_type(Block),
        mixed_precision=fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16),
        activation_checkpointing=True,
    )
    batch = torch.randint(0, 64, (2, 16))
    rng = torch.get_rng_state()
    real = fsdp_lite.estimate_memory(model, batch, 4, **kwargs)
    assert _snapshot(model) == before
    assert torch.equal(torch.get_rng_state(), rng)
    default_loss(model(batch)).backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.device("meta"):
        meta_model = _small_gpt()
    assert fsdp_lite.estimate_memory(meta_model, batch, 4, **kwargs) == real


def test_meta_model_is_not_allocated() -> None:
    """A 335M-parameter GPT (1.3 GB in fp32) on the meta device: the estimate allocates a few
    MB, and its shards are this rank's padded 1/W of every unit."""
    cfg = GPTConfig(vocab_size=32000, block_size=256, n_layer=24, n_head=16, n_embd=1024)
    with torch.device("meta"):
        model = GPT(cfg)
    world = 64
    with MemoryRecorder("cpu") as rec:
        with rec.step():
            est = fsdp_lite.estimate_memory(
                model, torch.randint(0, 32000, (1, 256)), world,
                auto_wrap_policy=fsdp_lite.wrap.by_type(Block),
            )  # fmt: skip
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert model_bytes > 1.3e9
    assert rec.peak_bytes < 16 * 2**20, rec.peak_bytes
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - cfg.n_layer * per_block
    shards = [-(-n // world) * 4 for n in [per_block] * cfg.n_layer + [root]]  # padded, fp32
    assert est.breakdown["shards"] == sum(shards)
    # AdamW: two fp32 states per shard element, and a 4-byte step count per shard
    assert est.breakdown["optimizer_state"] == 2 * sum(shards) + 4 * len(shards)


def test_layout_matches_wrapping(world1: None) -> None:
    """The units and flat params the planner works out are those FSDPModule builds: a
    size-based policy (it counts only parameters no nested unit took), a tied embedding,
    and the root taking what is left."""
    from fsdp_lite.core.tree import units_of
    from fsdp_lite.planner.layout import layout_units

    policy = fsdp_lite.wrap.by_size(3000)
    planned = layout_units(_small_gpt(), 1, policy, None)
    wrapped = fsdp_lite.FSDPModule(_small_gpt(), auto_wrap_policy=policy)
    got = sorted(tuple(f.numel for f in u.flat_params) for u in units_of(wrapped))
    assert sorted(tuple(f.numel for f in u.flats) for u in planned) == got
    assert len(planned) > 2  # blocks' submodules became units, not only the root


def test_plan_picks_the_fastest_that_fits_and_says_why_nothing_fits() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(**GPT_SIZES))
    batch = torch.randint(0, GPT_SIZES["vocab_size"], (2, 64))
    kwargs = dict(auto_wrap_policy=fsdp_lite.wrap.by_type(Block), backend="fake")
    roomy = fsdp_lite.plan(model, batch, 8, 2**40, **kwargs)
    assert (roomy.reshard_after_forward, roomy.activation_checkpointing, roomy.offload) == (
        False, False, None,
    )  # fmt: skip
    assert roomy.prefetch == fsdp_lite.PrefetchPolicy()
    default = fsdp_lite.estimate_memory(model, batch, 8, **kwargs)
    fixed = fsdp_lite.plan(
        model, batch, 8, default.peak_bytes, reshard_after_forward=None, **kwargs
    )  # held fixed: the default settings fit exactly
    assert fixed.reshard_after_forward is None and not fixed.activation_checkpointing
    assert fixed.estimate.peak_bytes <= default.peak_bytes
    with pytest.raises(ValueError, match=r"smallest estimate is .* MiB .* To fit, try"):
        fsdp_lite.plan(model, batch, 8, 2**20, **kwargs)
    # Accumulating: keeping every unit gathered first, then unsynced sums, then syncing.
    modes = {
        mode: fsdp_lite.estimate_memory(model, batch, 8, grad_accumulation=mode, **kwargs)
        for mode in ("keep", "no_sync", "sync")
    }
    keep, no_sync, sync = (modes[m].peak_bytes for m in ("keep", "no_sync", "sync"))
    assert keep > no_sync > sync > 0, modes
    assert modes["keep"].breakdown["grad_accumulators"] > 0
    assert modes["sync"].breakdown["grad_accumulators"] == 0
    auto = dict(kwargs, grad_accumulation="auto", reshard_after_forward=None, prefetch=None)
    for budget, chosen in ((keep, "keep"), (no_sync, "no_sync"), (sync, "sync")):
        found = fsdp_lite.plan(model, batch, 8, budget, **auto)
        assert found.grad_accumulation == chosen, (budget, found)
    assert fsdp_lite.plan(model, batch, 8, 2**40, **kwargs).grad_accumulation is None


if __name__ == "__main__":
    worker(int(sys.argv[1]))
