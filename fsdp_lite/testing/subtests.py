"""Run many named cases inside one spawn, and report every failing one by name.

FSDP2's ``run_subtests`` pattern: a case that fails is recorded and the next one runs,
so one broken feature does not hide the state of the others. Each rank returns its
``{case: error or None}``; the parent merges them with :func:`assert_subtests_passed`.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

_TESTING_DIR = os.path.dirname(os.path.abspath(__file__))
_LIBRARY_DIR = os.path.dirname(_TESTING_DIR)

# Errors a library raises on purpose, with a message, when it refuses a call.
_DELIBERATE = (RuntimeError, ValueError, NotImplementedError)


def run_subtests(cases: Iterable[tuple[str, Callable[[], Any]]]) -> dict[str, str | None]:
    """Run every ``(name, fn)``; return name -> ``None`` if it passed, else a one-line error.

    Every rank must run the same cases in the same order. A case that fails on some ranks
    only must say so collectively (see :func:`agree`), or its peers run ahead into the
    next case's collectives.
    """
    results: dict[str, str | None] = {}
    for name, fn in cases:
        if name in results:
            raise ValueError(f"run_subtests: two cases are named {name!r}")
        try:
            fn()
            results[name] = None
        except Exception as exc:  # noqa: BLE001 - every case reports, whatever it raised
            results[name] = one_line(exc)
    return results


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message (file:line of the innermost non-test frame)``."""
    message = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    frames = traceback.extract_tb(exc.__traceback__)
    inner = [f for f in frames if not f.filename.startswith(_TESTING_DIR)] or frames
    where = f" ({os.path.basename(inner[-1].filename)}:{inner[-1].lineno})" if inner else ""
    return f"{type(exc).__name__}: {message}{where}"


def agree(what: str, check: Callable[[], None]) -> None:
    """Run a rank-local ``check`` (it raises AssertionError on a mismatch); raise on every
    rank if it failed on any, so all ranks leave the case at the same point."""
    try:
        check()
        mine = None
    except AssertionError as exc:
        mine = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else what
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, mine)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise AssertionError(f"{what}: " + "; ".join(failed))


def assert_subtests_passed(per_rank: list[dict[str, str | None]]) -> None:
    """Merge the ranks' results; print one line per case; raise listing every failure
    (one error per case when every rank said the same, else each rank's)."""
    names = list(per_rank[0])
    failed: dict[str, dict[int, str]] = {}
    for rank, results in enumerate(per_rank):
        for name, error in results.items():
            if error is not None:
                failed.setdefault(name, {})[rank] = error
    for name in names:
        print(f"{'FAIL' if name in failed else 'ok  '} {name}")
    if failed:
        lines = []
        for name, errors in failed.items():
            if len(errors) == len(per_rank) and len(set(errors.values())) == 1:
                lines.append(f"- {name}: {errors[0]}")
            else:
                lines.append(f"- {name}: " + "; ".join(f"rank {r}: {e}" for r, e in errors.items()))
        raise AssertionError(f"{len(failed)} of {len(names)} cases failed:\n" + "\n".join(lines))
