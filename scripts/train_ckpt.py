"""The training script's checkpoints: where they live, what ``extra`` holds, resuming.

A run's checkpoints are ``<checkpoint.dir>/step_<N>`` directories written by
``fsdp_lite.save_checkpoint`` (sharded, atomic: a directory under that name is complete;
a save cut short leaves only ``step_<N>.tmp``). Besides the model and optimizer, its
``extra`` holds the step and every rank's resumable state -- data position, loss scale,
and the RNG states (torch CPU, CUDA when present, Python) -- so a resumed run draws the
same batches and dropout masks as an uninterrupted one and its loss curve is the same
(bitwise on CPU at the same world size).
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


def clear_checkpoints(root: Path) -> int:
    """A fresh run removes the checkpoints a previous run of the same name left, so that a
    restart cannot resume from them. Returns how many it removed (rank 0 only)."""
    removed = 0
    if root.is_dir():
        for entry in root.iterdir():
            if _STEP_DIR.match(entry.name) and entry.is_dir():
                shutil.rmtree(entry)
                removed += 1
    return removed


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
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save(
    cfg: Config,
    step: int,
    model: fsdp_lite.FSDPModule,
    opt: torch.optim.Optimizer,
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
    fsdp_lite.save_checkpoint(path, model, opt, extra=extra)
    if d.rank == 0:
        _prune(root, cfg.checkpoint.keep)
    return path


def restore(
    path: Path, model: fsdp_lite.FSDPModule, opt: torch.optim.Optimizer, cfg: Config, d: Dist
) -> tuple[int, dict[str, Any], str]:
    """Load ``path`` into ``model`` and ``opt``; restore this rank's RNG states. Returns the
    step it was saved at, this rank's resumable state and a note for the log.

    At another world size the model and optimizer reshard; the data position carries
    over, but RNG states cannot (there is no rank to take them from), so dropout is
    reseeded and the loss curve is no longer the uninterrupted one's."""
    extra = fsdp_lite.load_checkpoint(path, model, opt)
    step = int(extra["step"])
    if extra["world_size"] == d.world_size:
        local = extra["ranks"][d.rank]
        set_rng_state(local["rng"], d.device)
        return step, local, f"resumed from {path} at step {step}"
    torch.manual_seed(cfg.train.seed + d.rank + 1_000_003 * step)
    note = (
        f"resumed from {path} at step {step}, saved by {extra['world_size']} rank(s), "
        f"resharded to {d.world_size}: dropout RNG reseeded"
    )
    return step, extra["ranks"][0], note
