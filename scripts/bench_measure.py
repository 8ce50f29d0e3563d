"""How every benchmark in ``scripts/`` measures, the same way for all of them.

The ``bench*.py`` files declare what they measure (systems, models, configurations, which
figures go in which table) and call this module for the rest: the processes ranks run in,
step timing and the slowest-rank / median-of-rounds reductions, the collectives each rank
issues (patched in at the ProcessGroup), RSS, fsdp_lite's own accounting, and the reports
(provenance, markdown tables, BENCHMARKS.md blocks, JSON). Ranks are spawned and tensor
memory is read by the package's own ``fsdp_lite.testing`` (``run_distributed``,
``MemoryRecorder``). It imports no bench file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import multiprocessing
import os
import platform
import resource
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

import fsdp_lite

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
GIB = 2**30
T = TypeVar("T")

# -- arguments ---------------------------------------------------------------------------


def make_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose --help prints the bench's docstring as written."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_config_args(
    p: argparse.ArgumentParser, defaults: Any, names: Iterable[str], helps: dict | None = None
) -> None:
    """``--name`` for each field ``name`` of a config dataclass, typed and defaulted by
    ``defaults``, so the flags and the config cannot disagree."""
    for name in names:
        value = getattr(defaults, name)
        p.add_argument(
            f"--{name.replace('_', '-')}", type=type(value), default=value,
            help=(helps or {}).get(name),
        )  # fmt: skip


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """An instance of the config dataclass ``cls`` from the parsed flags that name its
    fields (the rest keep their defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def add_output_args(p: argparse.ArgumentParser, json_default: Path | None) -> None:
    """--out (the markdown report), --json (raw results), --no-write (print only)."""
    p.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md", help="markdown report")
    p.add_argument(
        "--json", type=Path, default=json_default,
        help="raw results" + ("" if json_default else " (default: next to --out)"),
    )  # fmt: skip
    p.add_argument("--no-write", action="store_true", help="print the report, write nothing")


def pick(value: str, allowed: Sequence[str], flag: str) -> list[str]:
    """The comma-separated names in ``value``, each one of ``allowed``."""
    picked = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in picked if v not in allowed]
    if bad or not picked:
        raise SystemExit(f"{flag}: unknown {bad or value!r}; choose from {', '.join(allowed)}")
    return picked


# -- processes ---------------------------------------------------------------------------


def use_cuda(world: int) -> bool:
    """Whether ``world`` ranks get a GPU each (then NCCL), else gloo on the CPU."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= world


def rank_device() -> torch.device:
    """The device this rank's process group runs on: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def fake_group(rank: int, world: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world`` on torch's fake process group
    (collectives complete at once and move nothing: what one rank of a real job holds
    and does on its host), one thread."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    # Rows no rank writes (uneven gathers, whole params) stay uninitialized, and denormals
    # among them would slow the arithmetic.
    torch.set_flush_denormal(True)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_rank(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    *args: Any,
    timeout_s: float | None = None,
    quiet: bool = False,
) -> Any:
    """``fn(rank, world, *args)`` in a fresh process on the fake process group (one per
    process), with ``OMP_NUM_THREADS=1``; its JSON-able result. ``quiet``: the child's
    stdout is dropped. Callers run one at a time, so each has the machine to itself."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fsdp_bench_fake_") as tmp:
        out = Path(tmp, "result.json")
        proc = ctx.Process(target=_fake_child, args=(fn, rank, world, args, str(out), quiet))
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


def _fake_child(fn: Callable, rank: int, world: int, args: tuple, out: str, quiet: bool) -> None:
    if quiet:
        sys.stdout.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    with fake_group(rank, world):
        result = fn(rank, world, *args)
    Path(out).write_text(json.dumps(result))


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


def add_counts(into: Counts, counts: Counts) -> None:
    """Add ``counts`` (as ``count_collectives`` yields them) to ``into``."""
    for kind, c in counts.items():
        for field, v in c.items():
            into[kind][field] += v


def per_step(counts: Counts, steps: int) -> dict[str, dict[str, float]]:
    """``counts`` over ``steps`` steps as plain dicts per step."""
    return {kind: {f: v / steps for f, v in c.items()} for kind, c in counts.items()}


@contextlib.contextmanager
def count_collectives() -> Iterator[Counts]:
    """Patch the ProcessGroup collectives; yield {kind: {calls, bytes, wire_bytes}}."""
    counts = new_counts()
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


def model_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's shards, shard grads and optimizer state (storage, deduplicated)."""
    seen: set[int] = set()

    def nbytes(tensors: Iterable[torch.Tensor]) -> int:
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
        "params": nbytes(params),
        "grads": nbytes(p.grad for p in params if p.grad is not None),
        "optimizer": nbytes(
            v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
        ),
    }


def count_params(make_model: Callable[[], nn.Module]) -> int:
    """Ψ of the model ``make_model`` builds (on meta: nothing allocated), a tied weight
    counted once."""
    with torch.device("meta"):
        return sum(p.numel() for p in make_model().parameters())


# -- process memory ----------------------------------------------------------------------


def max_rss_bytes() -> float:
    """This process's largest resident set so far (``getrusage``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """This process's largest resident set since ``reset_peak_rss`` (VmHWM)."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


# -- fsdp_lite's own accounting ------------------------------------------------------------


class LibraryAccounting:
    """fsdp_lite's own per-step figures, read through whatever API this version offers.

    ``fsdp_lite.stats()`` / ``reset_stats()`` (bytes, exposed communication, peak full
    parameter bytes) when present, else ``comm_stats()`` / ``reset_comm_stats()``; nothing
    for the other systems. Reset before and read after each step, outside the timing.
    """

    def __init__(self, system: str) -> None:
        self.api = ""
        self.read: Callable[[], Any] | None = None
        self.reset: Callable[[], Any] | None = None
        self.steps: list[Any] = []
        pairs = [("stats", "reset_stats"), ("comm_stats", "reset_comm_stats")]
        for read, reset in pairs if system.startswith("fsdp_lite") else []:
            fns = getattr(fsdp_lite, read, None), getattr(fsdp_lite, reset, None)
            if all(callable(fn) for fn in fns):
                self.api, (self.read, self.reset) = read, fns
                break

    def before_step(self) -> None:
        if self.reset is not None:
            self.reset()

    def after_step(self) -> None:
        if self.read is not None:
            self.steps.append(jsonable(self.read()))

    def summary(self, step_times: list[float], model: nn.Module) -> dict[str, Any]:
        """The last step's figures, exposed communication over all steps, and the root's
        ``memory_stats()`` after the last step, as far as the library reports them."""
        if not self.steps:
            return {}
        last = self.steps[-1]
        out: dict[str, Any] = {"api": f"fsdp_lite.{self.api}()", "last_step": last}
        if callable(getattr(model, "memory_stats", None)):
            out["memory_stats"] = jsonable(model.memory_stats())
        exposed = [s.get("exposed_s") for s in self.steps if isinstance(s, dict)]
        if exposed and all(isinstance(e, (int, float)) for e in exposed):
            out["exposed_s_median"] = statistics.median(exposed)
            out["exposed_fraction"] = sum(exposed) / sum(step_times)
        peaks = [s.get("full_bytes_peak") for s in self.steps if isinstance(s, dict)]
        if peaks and all(isinstance(p, (int, float)) for p in peaks):
            out["full_bytes_peak"] = max(peaks)
        return out


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


def now() -> str:
    """The local time, to the second, with its offset."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def load_avg() -> list[float]:
    """The 1, 5 and 15 minute load averages: how busy the machine was."""
    return [round(x, 2) for x in os.getloadavg()]


def git_commit() -> str:
    """This checkout's short commit ("?" without git)."""
    try:
        git = ["git", "rev-parse", "--short", "HEAD"]
        return subprocess.run(git, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def machine() -> dict[str, Any]:
    """What ran the benchmark: CPU, cores, GPU, torch, python, commit, load now."""
    cpu = platform.processor() or "unknown"
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    cpu = names[0] if names else cpu
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
        "load_avg": load_avg(),
    }


def command_line(
    script: str, argv: list[str] | None, python: str | None = ".venv/bin/python"
) -> str:
    """The command that reproduces this run (``argv`` None: this process's arguments)."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join([*([python] if python else []), script, *args])


def run_info(script: str, argv: list[str] | None) -> dict[str, Any]:
    """The start of a report's provenance: date, command and machine."""
    return {"date": now(), "command": command_line(script, argv), "machine": machine()}


def run_line(date: str, m: dict[str, Any], gpu: bool = False) -> str:
    """The head of a report's provenance sentence, which the caller ends: "Run <date> on
    <cpu> (<cores> cores[, <gpu>]), torch <version>, commit <commit>"."""
    on_gpu = f", {m['gpu']}" if gpu and m["gpu"] else ""
    return (
        f"Run {date} on {m['cpu']} ({m['cores']} cores{on_gpu}), torch {m['torch']}, "
        f"commit {m['commit']}"
    )


# -- reports -------------------------------------------------------------------------------


def ratio(x: float, ref: float | None, digits: int = 2, unit: str = "x", missing: str = "-") -> str:
    """``x / ref`` as "1.23x"; ``missing`` without a reference."""
    return f"{x / ref:.{digits}f}{unit}" if ref else missing


def md_row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def md_table(columns: Sequence[str], rows: Iterable[Sequence[str]], align: str) -> list[str]:
    """A markdown table's lines; ``align`` has an ``l`` or ``r`` per column."""
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align)
    return [md_row(columns), rule, *(md_row(r) for r in rows)]


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


def write_json(path: Path | str, payload: Any) -> None:
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")


def publish(
    block: str,
    payload: Any,
    args: argparse.Namespace,
    markers: tuple[str, str],
    tag: str,
) -> None:
    """Print the report block; unless ``args.no_write``, put it between ``markers`` in
    ``args.out`` and ``payload`` in ``args.json``."""
    print(block)
    if args.no_write:
        return
    write_markdown(args.out, block, *markers)
    write_json(args.json, payload)
    print(f"[{tag}] wrote {args.out} and {args.json}")
