"""make gpu-check: the CUDA/NCCL paths on one GPU, in one command, under 8 minutes.

    PYTHONPATH=. python3 tests/gpu/gpu_check.py [--out gpu_check.md] [--dry-run]
        [--parts tier,w1,w2,fake8,syncs,bench,compile] [--budget 450]
    PYTHONPATH=. python3 tests/gpu/gpu_check.py --parts hostbound,offload --budget 420

Made for the lent GPU machine (one H100/H200, its python3 with torch 2.11, no pip). Parts:

- ``tier``: the suite's CUDA tier (``pytest -m cuda``), skipped cleanly without CUDA;
- ``w1``: one NCCL rank against a single-device reference, step by step (fp32 tight, bf16
  at the suite's tolerance): plain, bf16, activation checkpointing with dropout (the CUDA
  RNG replayed in recompute), CPU offload (pinned, non-blocking), SSD offload;
  ``save_checkpoint``/``load_checkpoint`` of CUDA shards; HF Llama ``generate()`` wrapped
  against unwrapped;
- ``w2``: two gloo ranks with CUDA tensors on the one GPU (NCCL refuses two ranks on one
  device) against the reference;
- ``fake8``: W=8 through torch's fake process group: per-rank peak memory of fsdp_lite
  and FSDP2 (the device's allocator peak);
- ``syncs``: the steady-state step under ``torch.cuda.set_sync_debug_mode("error")``:
  passes only with 0 host syncs;
- ``bench``: a ~1B Llama-style model, bf16 compute, fp32 reduce, W=1: tokens/s, MFU
  (6*params*tokens + attention FLOPs over the device's bf16 peak) and peak memory of
  fsdp_lite, FSDP2 and the unwrapped model (autocast, fp32 weights), interleaved rounds;
- ``compile``: ``compile_blocks`` against eager blocks, tokens/s.

Two more parts measure where fsdp_lite should lead FSDP2 (``gpu_measure_cases.py``;
``make gpu-measure``), run only when named:

- ``hostbound``: a deep, narrow Llama whose step the host paces: tokens/s and the host
  time per unit of each wrapper;
- ``offload``: CPU offload of the ~1.1B Llama against FSDP2's, then the largest Llama
  shape (3B, 7B) each trains one step with it.

Every part runs in its own process under a share of ``--budget`` seconds, prints its
lines as it goes (PASS / FAIL / figures) and appends them to the summary at once, so a
run cut short still says where it stood. Without CUDA, or with ``--dry-run``, every part
runs on the CPU with gloo and tiny sizes: that checks the plumbing and the summary; its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ("tier", "w1", "w2", "fake8", "syncs", "bench", "compile")  # the default
PARTS = (*CHECKS, "hostbound", "offload")
# Share of the budget each part may take (the bench and the tier are the long ones).
SHARES = {"tier": 0.1, "w1": 0.15, "w2": 0.1, "fake8": 0.1, "syncs": 0.05, "bench": 0.3,
          "compile": 0.2, "hostbound": 0.4, "offload": 0.6}  # fmt: skip
# Dense bf16 peak, FLOP/s, by device name (datasheet, SXM parts).
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_out = Path(os.environ["OUT"]) / "gpu_check.md" if os.environ.get("OUT") else None
    p.add_argument("--out", type=Path, default=default_out or ROOT / "gpu_check.md")
    p.add_argument(
        "--parts", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(PARTS)}"
    )
    p.add_argument("--budget", type=float, default=450.0, help="seconds for every part together")
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny sizes")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- the driver ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args.child, dry=args.dry_run)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with out.open("w") as summary:
        _write(summary, _header(args))
        failed = 0
        for i, part in enumerate(parts):
            # this part's share of what is left: time an earlier part did not use goes on
            left = args.budget - (time.monotonic() - start)
            share = left * SHARES[part] / sum(SHARES[p] for p in parts[i:])
            limit = min(left, max(share, 30.0))
            if limit < 20:
                _write(summary, f"\n## {part}\n\nSKIP {part}: out of budget ({left:.0f} s left)\n")
                continue
            _write(summary, f"\n## {part}\n")
            failed += _run_part(part, args.dry_run, limit, summary)
        took = time.monotonic() - start
        verdict = "PASS" if not failed else f"FAIL ({failed} failing lines)"
        _write(summary, f"\n## verdict\n\n{verdict}; {took:.0f} s in all\n")
    print(f"summary: {out}")
    return 1 if failed else 0


def _header(args: argparse.Namespace) -> str:
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.cuda.get_device_name(0) if cuda else "CPU (dry run: figures mean nothing)"
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return (
        f"# gpu-check\n\n{now}"
        f", {device}, torch {torch.__version__}, CUDA {torch.version.cuda}, commit {commit or '?'}"
        f"\n\n    PYTHONPATH=. python3 tests/gpu/gpu_check.py --parts {args.parts}"
        f" --budget {args.budget:.0f}{' --dry-run' if args.dry_run else ''}\n"
    )


def _write(summary, text: str) -> None:
    print(text, flush=True)
    summary.write(text + "\n")
    summary.flush()


def _run_part(part: str, dry: bool, limit: float, summary) -> int:
    """Run one part in its own process; copy its PASS/FAIL/figure lines as they come."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", part]
    if dry:
        cmd.append("--dry-run")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    failed = 0
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    tail: list[str] = []
    deadline = time.monotonic() + limit
    with _killed_at(proc, deadline):
        for line in proc.stdout:
            line = line.rstrip()
            if line.startswith(("PASS ", "FAIL ", "SKIP ", "INFO ", "|")):
                _write(summary, line)
                failed += line.startswith("FAIL ")
            else:
                tail = (tail + [line])[-15:]
        code = proc.wait()
    if time.monotonic() >= deadline:
        _write(summary, f"FAIL {part}: stopped after its {limit:.0f} s share of the budget")
        failed += 1
    elif code != 0:
        _write(
            summary, f"FAIL {part}: exited {code}; its last lines:\n\n    " + "\n    ".join(tail)
        )
        failed += 1
    return failed


@contextlib.contextmanager
def _killed_at(proc: subprocess.Popen, deadline: float):
    import threading

    def watch() -> None:
        while proc.poll() is None:
            if time.monotonic() >= deadline:
                proc.kill()
                return
            time.sleep(0.5)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(timeout=1)


# -- the parts, each in its own process ----------------------------------------------------


def run_child(part: str, dry: bool) -> int:
    import torch

    cuda = torch.cuda.is_available() and not dry
    ctx = _Context(cuda=cuda, dry=dry)
    {"tier": part_tier, "w1": part_w1, "w2": part_w2, "fake8": part_fake8,
     "syncs": part_syncs, "bench": part_bench, "compile": part_compile,
     "hostbound": part_hostbound, "offload": part_offload}[part](ctx)  # fmt: skip
    return 0


class _Context:
    def __init__(self, cuda: bool, dry: bool) -> None:
        import torch

        self.cuda, self.dry = cuda, dry
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        self.backend = "nccl" if cuda else "gloo"


def report(ok: bool, name: str, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def _checked(name: str, fn, *args) -> None:
    """Run one check; PASS with its returned detail, FAIL with the error's first line."""
    try:
        detail = fn(*args)
    except Exception as exc:  # noqa: BLE001 - every failure is reported, the rest goes on
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        report(False, name, f"{type(exc).__name__}: {first}")
    else:
        report(True, name, detail or "")


def part_tier(ctx: _Context) -> None:
    """The suite's CUDA tier; without CUDA every test skips (that is the pass)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"]
    env = {**os.environ, "COLUMNS": "300"}  # pytest's summary lines keep their messages
    if ctx.dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    last = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1:] or ["(no output)"]
    # pytest exits 5 when every test was deselected or none collected.
    ok = proc.returncode in (0, 5)
    report(ok, "CUDA tier (pytest -m cuda)", last[0])
    if not ok:
        for line in proc.stdout.splitlines():
            if line.startswith(("FAILED", "ERROR")):
                print(f"INFO {line[:300]}", flush=True)


@contextlib.contextmanager
def _one_rank(ctx: _Context):
    """A one-rank process group of the part's backend (NCCL on CUDA) around the body, and
    a scratch directory, yielded."""
    import torch
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        if ctx.cuda:
            torch.cuda.set_device(0)
        dist.init_process_group(ctx.backend, init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)  # fmt: skip
        try:
            yield tmp
        finally:
            dist.destroy_process_group()


def part_w1(ctx: _Context) -> None:
    from gpu_check_cases import w1_checks

    with _one_rank(ctx) as tmp:
        for name, fn in w1_checks(ctx.device, tmp):
            _checked(f"W=1 {ctx.backend} {name}", fn)


def part_w2(ctx: _Context) -> None:
    from gpu_check_cases import w2_gloo

    from fsdp_lite.testing import run_distributed

    def go() -> str:
        per_rank = run_distributed(w2_gloo, 2, str(ctx.device), timeout=240.0)
        failed = {n: e for results in per_rank for n, e in results.items() if e}
        if failed:
            raise AssertionError("; ".join(f"{n}: {e}" for n, e in failed.items()))
        return ", ".join(per_rank[0])

    _checked("W=2 gloo on one device", go)


def part_fake8(ctx: _Context) -> None:
    from gpu_check_cases import fake_pg_peaks

    for line in fake_pg_peaks(ctx.device, world=8, dry=ctx.dry):
        print(line, flush=True)


def part_syncs(ctx: _Context) -> None:
    from gpu_check_cases import steady_state_syncs

    if not ctx.cuda:
        print("SKIP host syncs: no CUDA device (set_sync_debug_mode is CUDA's)", flush=True)
        return
    with _one_rank(ctx):
        _checked("host syncs in the steady-state step = 0", steady_state_syncs, ctx.device)


def part_bench(ctx: _Context) -> None:
    from gpu_check_cases import llama_bench

    with _one_rank(ctx):
        for line in llama_bench(ctx.device, dry=ctx.dry, peaks=BF16_PEAK):
            print(line, flush=True)


def part_compile(ctx: _Context) -> None:
    from gpu_check_cases import compile_bench

    with _one_rank(ctx):
        for line in compile_bench(ctx.device, dry=ctx.dry):
            print(line, flush=True)


def part_hostbound(ctx: _Context) -> None:
    from gpu_measure_cases import host_bound_bench

    with _one_rank(ctx):
        for line in host_bound_bench(ctx.device, dry=ctx.dry):
            print(line, flush=True)


def part_offload(ctx: _Context) -> None:
    """The ~1.1B comparison, then the largest shapes in what is left of a fixed budget
    (each in a process of its own, outside this one's process group)."""
    from gpu_measure_cases import largest_offloaded, offload_bench

    with _one_rank(ctx):
        for line in offload_bench(ctx.device, dry=ctx.dry):
            print(line, flush=True)
    budget = float(os.environ.get("GPU_MEASURE_FIT_S", "150"))
    for line in largest_offloaded(ctx.device, dry=ctx.dry, budget_s=budget):
        print(line, flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
