"""How every benchmark measures and reports, the same way for all of them.

``scripts/bench.py`` declares the scenarios (which systems, which model, which figures in
which table); this module does the rest: the fake process group, step timing and the
slowest-rank / median reductions, the collectives each rank issues (patched in at the
ProcessGroup), RSS, model-state bytes, provenance, markdown tables, BENCHMARKS.md blocks
and JSON. Ranks are spawned and tensor memory is read by the package's own
``fsdp_lite.testing`` (``run_distributed``, ``MemoryRecorder``). It imports no bench file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import multiprocessing
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lite.testing.memory import storage_bytes
from fsdp_lite.testing.spawn import fake_group

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
GIB = 2**30
T = TypeVar("T")

# -- processes ---------------------------------------------------------------------------


def use_cuda(world: int) -> bool:
    """Whether ``world`` ranks get a GPU each (then NCCL), else gloo on the CPU."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= world


def rank_device() -> torch.device:
    """The device this rank's process group runs on: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def quiet_fake_rank() -> None:
    """One thread, and rows no rank writes on the fake process group (uneven gathers,
    whole params) left uninitialized without denormals among them slowing arithmetic."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)


def fake_rank(fn: Callable[..., Any], rank: int, world: int, *args: Any, timeout_s: float) -> Any:
    """``fn(rank, world, *args)`` in a fresh process on the fake process group (one per
    process), with ``OMP_NUM_THREADS=1`` and its stdout dropped; its JSON-able result.
    Callers run one at a time, so each has the machine to itself."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fsdp_bench_fake_") as tmp:
        out = Path(tmp, "result.json")
        proc = ctx.Process(target=_fake_child, args=(fn, rank, world, args, str(out)))
        threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # read when the child starts
        try:
            proc.start()
        finally:
            if threads is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = threads
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise SystemExit(f"{fn.__name__} rank {rank}/{world}: over {timeout_s} s, killed")
        if proc.exitcode:
            raise SystemExit(f"{fn.__name__} rank {rank}/{world}: exited {proc.exitcode}")
        return json.loads(out.read_text())


def _fake_child(fn: Callable, rank: int, world: int, args: tuple, out: str) -> None:
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    quiet_fake_rank()
    with fake_group(rank, world):
        result = fn(rank, world, *args)
    Path(out).write_text(json.dumps(jsonable(result)))


# -- time --------------------------------------------------------------------------------


class Stopwatch:
    """Wall time (``perf_counter``) and CPU time of every thread of this process
    (``process_time``: robust to other work on the machine) since it was made."""

    def __init__(self) -> None:
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def wall(self) -> float:
        return time.perf_counter() - self.start

    def cpu(self) -> float:
        return time.process_time() - self.cpu_start


@contextlib.contextmanager
def stage(label: str) -> Iterator[None]:
    """Print ``label: N s`` when the block is done: progress of a long run."""
    watch = Stopwatch()
    yield
    print(f"{label}: {watch.wall():.0f} s", flush=True)


def round_order(items: Sequence[T], rnd: int) -> list[T]:
    """``items`` in round ``rnd``'s order: each round starts one later, so that load from
    other work and the first-of-a-round penalty spread over all of them."""
    turn = rnd % len(items)
    return list(items[turn:]) + list(items[:turn])


def slowest_per_step(per_rank: Iterable[Sequence[float]]) -> list[float]:
    """Per step, the slowest rank's time: a step is done when every rank is."""
    return [max(step) for step in zip(*per_rank, strict=True)]


def median_of_rounds(rounds: Iterable[Sequence[float]]) -> float:
    """The median over rounds of each round's median: a round slowed by other work on
    the machine moves it less than pooling its steps would."""
    return statistics.median(statistics.median(r) for r in rounds)


# -- collectives, observed at the ProcessGroup methods every Python caller goes through ----

# ProcessGroup method -> (kind, index of the argument whose size is the collective's buffer).
# torch.distributed's functions (all_gather_into_tensor, _all_gather_base, all_reduce, ...)
# all end in one of these methods, whichever alias a library imported, so one patch sees
# FSDP2, FSDP1, fsdp_lite and DDP's stock all-reduce comm hook alike, each call once.
_GATHERS = ("all_gather_single", "_allgather_base", "allgather", "allgather_coalesced",
            "allgather_into_tensor_coalesced", "all_gather_single_coalesced")  # fmt: skip
_SCATTERS = ("reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter",
             "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced")  # fmt: skip
_PG_METHODS = {
    **dict.fromkeys(_GATHERS, ("all_gather", 0)),  # the output spans the whole buffer
    **dict.fromkeys(_SCATTERS, ("reduce_scatter", 1)),  # the input does
    **dict.fromkeys(("allreduce", "allreduce_coalesced"), ("all_reduce", 0)),
    "broadcast": ("broadcast", 0),
}

Counts = dict[str, dict[str, float]]  # {kind: {calls, bytes, wire_bytes}}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def wire_bytes(kind: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends for a collective spanning ``nbytes`` (ring algorithms)."""
    share = (world - 1) / world
    if kind == "all_reduce":  # a reduce-scatter plus an all-gather
        return 2 * share * nbytes
    # A broadcast: the source sends the buffer to its W-1 peers, so (W-1)/W of it per rank
    # when, as in fsdp_lite's gloo all-gather, every rank calls the same broadcasts.
    return share * nbytes


def new_counts() -> Counts:
    """An empty {kind: {field: total}} to add counts to."""
    return defaultdict(lambda: defaultdict(float))


def per_step(counts: Counts, steps: int) -> dict[str, dict[str, float]]:
    """``counts`` over ``steps`` steps as plain dicts per step."""
    return {kind: {f: v / steps for f, v in c.items()} for kind, c in counts.items()}


@contextlib.contextmanager
def count_collectives(counts: Counts | None = None) -> Iterator[Counts]:
    """Patch the ProcessGroup collectives; add {kind: {calls, bytes, wire_bytes}} of every
    call inside the block to ``counts`` (a new one by default) and yield it."""
    counts = new_counts() if counts is None else counts
    pg_cls = dist.ProcessGroup
    # The class __dict__ entries (pybind11 instance-method descriptors), so restoring
    # them keeps them bound methods; getattr(cls, name) would return plain functions.
    originals = {name: vars(pg_cls)[name] for name in _PG_METHODS if name in vars(pg_cls)}

    def patched(name: str, orig: Callable) -> Callable:
        kind, arg = _PG_METHODS[name]

        def call(self: dist.ProcessGroup, *args: Any, **kwargs: Any) -> Any:
            nbytes = _nbytes(args[arg]) if len(args) > arg else 0
            c = counts[kind]
            c["calls"] += 1
            c["bytes"] += nbytes
            # gloo has no reduce-scatter: ProcessGroupGloo runs it as an all-reduce of a copy.
            on_gloo = kind == "reduce_scatter" and "gloo" in dist.get_backend(self)
            c["wire_bytes"] += wire_bytes("all_reduce" if on_gloo else kind, nbytes, self.size())
            return orig(self, *args, **kwargs)

        return call

    for name, orig in originals.items():
        setattr(pg_cls, name, patched(name, orig))
    try:
        yield counts
    finally:
        for name, orig in originals.items():
            setattr(pg_cls, name, orig)


# -- memory --------------------------------------------------------------------------------


def model_state_bytes(model: nn.Module, opts: Iterable[Any]) -> dict[str, int]:
    """Bytes of this rank's shards, shard grads and optimizer state (storage, deduplicated)."""
    seen: set[int] = set()
    params = list(model.parameters())
    states = [v for o in opts for st in o.state.values() for v in st.values()]
    return {
        "params": storage_bytes(params, seen),
        "grads": storage_bytes((p.grad for p in params if p.grad is not None), seen),
        "optimizer": storage_bytes((v for v in states if isinstance(v, torch.Tensor)), seen),
    }


def count_params(make_model: Callable[[], nn.Module]) -> int:
    """Ψ of the model ``make_model`` builds (on meta: nothing allocated), a tied weight
    counted once."""
    with torch.device("meta"):
        return sum(p.numel() for p in make_model().parameters())


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set now (VmRSS), or its largest since ``reset_peak_rss``
    (``field="VmHWM"``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def jsonable(x: Any) -> Any:
    """``x`` as JSON can hold it: dataclasses and dicts as dicts, tensors as lists."""
    if hasattr(x, "__dataclass_fields__"):
        x = dataclasses.asdict(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return repr(x)


# -- provenance ----------------------------------------------------------------------------


def load_avg() -> list[float]:
    """The 1, 5 and 15 minute load averages: how busy the machine was."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    """What ran the benchmark: CPU, cores, GPU, torch, python, commit, load now."""
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    try:
        git = ["git", "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(git, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([".venv/bin/python", "scripts/bench.py", *sys.argv[1:]]),
        "cpu": names[0] if names else platform.processor() or "unknown",
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit or "?",
        "load_avg": load_avg(),
    }


def provenance(m: dict[str, Any], wall_s: float) -> list[str]:
    """A report's first lines: when, where, on what, how busy, how long, and the command."""
    gpu = f", {m['gpu']}" if m["gpu"] else ""
    return [
        f"Run {m['date']} on {m['cpu']} ({m['cores']} cores{gpu}), torch {m['torch']}, commit "
        f"{m['commit']}; load average at start {m['load_avg']}, at end {load_avg()}; "
        f"{wall_s:.0f} s in all.",
        "",
        f"    {m['command']}",
        "",
    ]


# -- reports -------------------------------------------------------------------------------


def ratio(x: float | None, ref: float | None, digits: int = 2, unit: str = "x") -> str:
    """``x / ref`` as "1.23x"; "-" without both."""
    return f"{x / ref:.{digits}f}{unit}" if x is not None and ref else "-"


def md_row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def md_table(columns: Sequence[str], rows: Iterable[Sequence[str]], align: str = "") -> list[str]:
    """A markdown table's lines; ``align`` has an ``l`` or ``r`` per column (first column
    left, the rest right by default)."""
    align = align or "l" + "r" * (len(columns) - 1)
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align)
    return [md_row(columns), rule, *(md_row(r) for r in rows)]


@dataclasses.dataclass(frozen=True)
class Col:
    """A table column: ``title``, the figure ``key`` of each row and its format; ``vs``:
    followed by the row's ratio to the reference row's."""

    title: str
    key: str
    fmt: str = "{:.1f}"
    vs: bool = False


def table(rows: dict[str, dict[str, Any]], cols: Sequence[Col], ref: str | None) -> list[str]:
    """A markdown table of ``rows`` ({label: figures}), one column per ``cols`` entry, a
    "vs <ref>" ratio after each ``vs`` column."""
    titles = ["", *(t for c in cols for t in ([c.title, f"vs {ref}"] if c.vs else [c.title]))]
    base = rows.get(ref or "", {})
    body = []
    for label, r in rows.items():
        cells = [label]
        for c in cols:
            v = r.get(c.key)
            cells.append("-" if v is None else c.fmt.format(v))
            if c.vs:
                cells.append(ratio(v, base.get(c.key)))
        body.append(cells)
    return md_table(titles, body)


def write_markdown(path: Path, block: str, begin: str, end: str) -> None:
    """Replace the block between ``begin`` and ``end`` in ``path`` (keeping any text around
    it), append it if absent, or create the file."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def publish(lines: list[str], payload: Any, marker: str | None, out: Path, write: bool) -> None:
    """Print the report; with ``write`` and a ``marker``, put it between the
    ``<!-- bench-<marker>:begin/end -->`` lines of ``out`` (BENCHMARKS.md) and ``payload``
    in ``BENCHMARKS_<marker>.json`` beside it."""
    if marker is None:
        print("\n".join(lines))
        return
    begin, end = f"<!-- bench-{marker}:begin -->", f"<!-- bench-{marker}:end -->"
    block = "\n".join([begin, *lines, end])
    print(block)
    if write:
        write_markdown(out, block, begin, end)
        js = out.with_name(f"{out.stem}_{marker}.json")
        js.write_text(json.dumps(jsonable(payload), indent=1) + "\n")
        print(f"[bench] wrote {out} and {js}")
