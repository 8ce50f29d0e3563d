"""The training script's checkpoints: where they live, what ``extra`` holds, resuming.

A run's checkpoints are ``<checkpoint.dir>/step_<N>`` directories written by
``fsdp_lite.save_checkpoint`` (sharded, atomic: a directory under that name is complete;
a save cut short leaves only ``step_<N>.tmp``). Besides the model and optimizer, its
``extra`` holds the step and every rank's resumable state -- data position, loss scale,
and the RNG states (torch CPU, CUDA when present, Python) -- so a resumed run draws the
same batches and dropout masks as an uninterrupted one and its loss curve is the same
(bitwise on CPU at the same world size). A run never deletes a checkpoint it did not
write: a fresh run refuses to start where an earlier run of its name left some, unless
told to continue (``--resume``) or to start over (``--overwrite``); see ``prepare_start``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from train_config import Config
from train_setup import Dist

import fsdp_lite
from fsdp_lite.core import devices

_STEP_DIR = re.compile(r"^step_(\d+)(\.tmp|\.old)?$")


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir or os.path.join("checkpoints", cfg.name))


def restart_count() -> int:
    """How many times torchrun has restarted this job (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints under ``root``, oldest first."""
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and not match.group(2) and (entry / ".metadata").is_file():
                found.append((int(match.group(1)), entry))
    return sorted(found)


def resume_source(cfg: Config) -> Path | None:
    """The checkpoint to resume from, or None to start fresh. A torchrun restart resumes
    from the latest checkpoint whatever ``checkpoint.resume`` says."""
    mode = cfg.checkpoint.resume
    if mode == "never" and restart_count() > 0:
        mode = "auto"
    if mode == "never":
        return None
    if mode == "auto":
        found = complete_checkpoints(checkpoint_root(cfg))
        return found[-1][1] if found else None
    return Path(mode)


class RunExistsError(RuntimeError):
    """A fresh run found what an earlier run of its name left; the message says what to do."""


_REFUSED = ".refused"  # a first attempt refused to start: its torchrun restarts refuse too
_HF_EXPORT = "hf_final"


def hf_export_dir(cfg: Config) -> Path:
    """Where the final model is exported as a Hugging Face checkpoint (``model.hf`` runs)."""
    return checkpoint_root(cfg) / _HF_EXPORT


def earlier_outputs(root: Path) -> list[Path]:
    """What runs of this name left under ``root``: checkpoints, complete or cut short, and
    the HF export."""
    if not root.is_dir():
        return []
    return sorted(e for e in root.iterdir() if _STEP_DIR.match(e.name) or e.name == _HF_EXPORT)


def _continues(cfg: Config, root: Path) -> bool:
    """Whether the run continues the checkpoints under ``root``: ``--resume`` (``auto``), or
    resume from a checkpoint under it."""
    mode = cfg.checkpoint.resume
    return mode == "auto" or (mode != "never" and root.resolve() in Path(mode).resolve().parents)


def _refusal(cfg: Config, root: Path, found: list[Path]) -> RunExistsError:
    names = ", ".join(p.name for p in found[:4]) + (f", {len(found) - 4} more" if found[4:] else "")
    return RunExistsError(
        f"{root} holds what an earlier run named '{cfg.name}' left ({names}); a fresh run "
        "neither deletes nor resumes checkpoints it did not write. Continue that run with "
        f"--resume, start a new one under another name (--set name={cfg.name}-2), or start "
        "over with --overwrite, which deletes them."
    )


def prepare_start(cfg: Config, overwrite: bool, rank: int) -> str:
    """Every rank calls it first thing, before the model and the process group exist.

    A run that does not continue its name's checkpoints (no ``--resume``) refuses to start,
    raising :class:`RunExistsError`, where an earlier run of its name left checkpoints: it
    would resume them on a torchrun restart and prune them as it saves. ``overwrite``
    (``--overwrite``) is the one way to start over: rank 0 deletes them. A torchrun restart
    deletes nothing (it resumes from this job's own checkpoints) and refuses again if the
    first attempt refused, which leaves ``.refused`` under the root for it (torchrun
    restarts a job whatever made it fail). Returns a note for the log."""
    root = checkpoint_root(cfg)
    found, marker = earlier_outputs(root), root / _REFUSED
    if restart_count() > 0:
        if marker.exists():
            raise _refusal(cfg, root, found)
        return ""
    if found and not overwrite and not _continues(cfg, root):
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0:
            marker.touch()
        raise _refusal(cfg, root, found)
    if rank != 0:
        return ""
    marker.unlink(missing_ok=True)
    if not overwrite or not found:
        return ""
    for path in found:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return f"--overwrite: deleted {len(found)} checkpoint(s) of an earlier run from {root}"


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    complete = complete_checkpoints(root)
    for _, path in complete[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    newest = complete[-1][0] if complete else -1
    for entry in root.iterdir():  # saves cut short before the newest one finished
        match = _STEP_DIR.match(entry.name)
        if match and match.group(2) and int(match.group(1)) < newest:
            shutil.rmtree(entry, ignore_errors=True)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's generators: torch's (CPU and ``device``'s, ``devices.rng_state``) and
    Python's."""
    return {"torch": devices.rng_state(device), "python": random.getstate()}


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    devices.set_rng_state(state["torch"], device)
    random.setstate(state["python"])


def save(
    cfg: Config,
    step: int,
    model: fsdp_lite.FSDPModule,
    opts: list[torch.optim.Optimizer],
    local: dict[str, Any],
    d: Dist,
) -> Path:
    """Checkpoint ``step``; ``local`` is this rank's resumable state. Every rank calls it.

    Every rank's ``local`` is gathered into every rank's ``extra``, so a rank finds its own
    state whichever shard group it belongs to (hybrid sharding)."""
    root = checkpoint_root(cfg)
    ranks: list[Any] = [None] * d.world_size
    local = {**local, "rng": rng_state(d.device)}
    if d.world_size > 1:
        dist.all_gather_object(ranks, local)
    else:
        ranks = [local]
    extra = {"step": step, "world_size": d.world_size, "ranks": ranks}
    path = root / f"step_{step:07d}"
    fsdp_lite.save_checkpoint(path, model, opts, extra=extra)
    if d.rank == 0:
        _prune(root, cfg.checkpoint.keep)
    return path


def restore(
    path: Path,
    model: fsdp_lite.FSDPModule,
    opts: list[torch.optim.Optimizer],
    cfg: Config,
    d: Dist,
) -> tuple[int, dict[str, Any], str]:
    """Load ``path`` into ``model`` and ``opts``; restore this rank's RNG states. Returns the
    step it was saved at, this rank's resumable state and a note for the log.

    At another world size the model and optimizer reshard; the data position carries
    over, but RNG states cannot (there is no rank to take them from), so dropout is
    reseeded and the loss curve is no longer the uninterrupted one's."""
    extra = fsdp_lite.load_checkpoint(path, model, opts)
    step = int(extra["step"])
    if extra["world_size"] == d.world_size:
        local = extra["ranks"][d.rank]
        set_rng_state(local["rng"], d.device)
        return step, local, f"resumed from {path} at step {step}"
    torch.manual_seed(cfg.train.seed + d.dp_rank + 1_000_003 * step)
    note = (
        f"resumed from {path} at step {step}, saved by {extra['world_size']} rank(s), "
        f"resharded to {d.world_size}: dropout RNG reseeded"
    )
    return step, extra["ranks"][0], note
