"""The training script's setup: process group, the wrapped model, schedule, loss scaling,
Hugging Face models, and checkpoints.

``build_model`` (the GPT, or a Hugging Face causal LM with ``model.hf``) is the one place
that composes fsdp_lite's features, in torchtitan's order: activation checkpointing per
block, then a unit per block (or by size), then the root, with the offload, prefetch,
mixed-precision and hybrid-sharding policies the config picks.

``model.hf`` names a directory holding ``config.json`` (plus, optionally, ``*.safetensors``
weights and tokenizer files) or a single HF config ``.json`` file. With weights the model
is ``from_pretrained``; without, ``from_config`` (random init, seeded alike on every rank).
transformers is imported only inside the functions that need it, so runs of the built-in
GPT never import it.

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

import datetime
import math
import os
import random
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from train_config import Config, ConfigError, TrainConfig

import fsdp_lite
from fsdp_lite.core import devices
from fsdp_lite.testing.models import GPT, Block, GPTConfig, parallelize_gpt

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device
    tp: int = 1  # tensor-parallel degree (parallel.tp): ranks rank // tp share their data
    mesh: DeviceMesh | None = None  # (dp..., "tp") when tp > 1

    @property
    def dp_rank(self) -> int:
        """This rank's slice of every global batch (its TP group's)."""
        return self.rank // self.tp

    @property
    def dp_size(self) -> int:
        """How many ranks see different data."""
        return self.world_size // self.tp


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def init_distributed(timeout_s: float, tp: int = 1) -> Dist:
    """NCCL + cuda:LOCAL_RANK if CUDA is available, else gloo + CPU; one rank without torchrun.

    ``timeout_s`` bounds every collective: a peer that stopped answering fails the job
    after it (a peer that died is usually noticed at once: its sockets close)."""
    cuda = torch.cuda.is_available()
    timeout = datetime.timedelta(seconds=timeout_s)
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if local_world > torch.cuda.device_count():
            raise ConfigError(
                f"{local_world} ranks per node need as many GPUs; this node has "
                f"{torch.cuda.device_count()} (lower --nproc_per_node)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group(
            backend,
            store=_store(timeout),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
            device_id=device if cuda else None,
        )
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world_size = dist.get_world_size()
    if not cuda:  # ranks share the cores
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return Dist(dist.get_rank(), world_size, device, tp)


def _store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's rendezvous store, with the keys of each restart kept apart.

    [Note: restarts and the shared store]
    By default torchrun's workers share its rendezvous TCPStore, which outlives a restart;
    the process group keeps its keys (each rank's address) under the same names in every
    attempt, so a restarted rank can read a dead rank's address and fail to connect
    (pytorch/pytorch#135712, #167288). On one node every worker restarts together, so the
    restart count names the attempt consistently and prefixes its keys. Across nodes the
    agents' counts can differ: there ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh
    store per attempt) is the fix, and rank 0 says so.
    """
    env = os.environ
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's own store
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        int(env["WORLD_SIZE"]),
        is_master=not shared and env["RANK"] == "0",
        timeout=timeout,
        multi_tenant=True,
    )
    if shared and int(env.get("GROUP_WORLD_SIZE", 1)) == 1:
        return dist.PrefixStore(f"train/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)
    if shared and int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)) and env["RANK"] == "0":
        print(
            "warning: torchrun --max-restarts across nodes with a shared rendezvous store: a "
            "restart can read stale addresses; export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on "
            "every node (pytorch/pytorch#135712)",
            file=sys.stderr,
        )
    return store


def _offload(cfg: Config) -> fsdp_lite.CPUOffload | fsdp_lite.SSDOffload | None:
    f = cfg.fsdp
    if f.offload == "cpu":
        return fsdp_lite.CPUOffload()
    if f.offload == "ssd":
        path = f.offload_dir or os.path.join(tempfile.gettempdir(), f"fsdp_lite_{cfg.name}")
        return fsdp_lite.SSDOffload(path)
    return None


def _wrap_policy(
    cfg: Config, model: nn.Module, blocks: tuple[type[nn.Module], ...]
) -> fsdp_lite.wrap.Policy | None:
    """Which submodules become units; activation checkpointing is applied first, so with
    ``wrap: block`` each unit wraps a checkpointed block (``blocks``: the block classes)."""
    unit_types: tuple[type, ...] = blocks
    if cfg.fsdp.activation_checkpointing:
        fsdp_lite.apply_activation_checkpointing(model, fsdp_lite.wrap.by_type(*blocks))
        unit_types = (fsdp_lite.CheckpointWrapper,)
    if cfg.fsdp.wrap == "block":  # each block, the embedding and the head: one unit each
        ends = fsdp_lite.wrap.embeddings_and_head(model)
        return fsdp_lite.wrap.any_of(fsdp_lite.wrap.by_type(*unit_types), ends)
    if cfg.fsdp.wrap == "size":
        by_size = fsdp_lite.wrap.by_size(cfg.fsdp.wrap_min_params)
        # Containers have no forward of their own: a unit around one would never run.
        return lambda m: not isinstance(m, nn.ModuleList | nn.ModuleDict) and by_size(m)
    return None


def _inner_model(cfg: Config, vocab_size: int) -> tuple[nn.Module, tuple[type[nn.Module], ...]]:
    """The unwrapped model and its block classes: the GPT, or the ``model.hf`` causal LM."""
    m = cfg.model
    if m.hf is not None:
        model = build_hf_model(cfg)
        return model, layer_classes(model)
    gpt = GPT(GPTConfig(vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd, m.dropout))
    return gpt, (Block,)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, hf: bool) -> torch.Tensor:
    """Mean next-token cross-entropy; ``y`` is ``x`` shifted by one (each (B, T)). The GPT
    computes it itself; for an HF model it is taken on the logits against the shifted ``y``
    (``labels=`` would shift a second time)."""
    if not hf:
        return model(x, y)[1]
    logits = model(input_ids=x, use_cache=False).logits  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def build_model(cfg: Config, vocab_size: int, d: Dist) -> tuple[fsdp_lite.FSDPModule, int]:
    """The wrapped model (the GPT or ``model.hf``) and its parameter count (tied weights
    counted once)."""
    f = cfg.fsdp
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    inner, blocks = _inner_model(cfg, vocab_size)
    n_params = sum(p.numel() for p in inner.parameters())
    if f.compile:  # before wrapping: fsdp_lite's hooks stay outside the compiled forwards
        compiled = fsdp_lite.compile_blocks(inner, blocks)
        if d.rank == 0:
            kinds = "/".join(c.__name__ for c in blocks)
            print(
                f"fsdp.compile: torch.compile (inductor, fullgraph) of the forward of "
                f"{len(compiled)} blocks ({kinds}), {compiled[0]} .. {compiled[-1]}; the first "
                "steps include compile time",
                flush=True,
            )
    dtype = DTYPES[f.mixed_precision]
    mp = None if dtype == torch.float32 else fsdp_lite.MixedPrecision(dtype, torch.float32)
    groups, mesh = None, None
    if d.tp > 1:  # TP over groups of tp ranks, fsdp_lite over the data-parallel dims
        mesh = _parallelize(cfg, inner, d)
    elif f.shard_size is not None and f.shard_size != d.world_size:
        groups = fsdp_lite.hybrid_groups(f.shard_size)
    # max_in_flight counts the running unit's own gather too
    prefetch = fsdp_lite.PrefetchPolicy(max_in_flight=f.prefetch + 1) if f.prefetch else None
    model = fsdp_lite.FSDPModule(
        inner,
        process_group=groups,
        mesh=mesh,
        auto_wrap_policy=_wrap_policy(cfg, inner, blocks),
        reshard_after_forward=f.reshard_after_forward,
        mixed_precision=mp,
        sync_module_states=True,
        device=d.device,
        prefetch=prefetch,
        offload=_offload(cfg),
        # Muon steps whole matrices
        optimizer_params="whole" if cfg.optim.name == "muon" else "flat",
    )
    torch.manual_seed(cfg.train.seed + d.dp_rank)  # dropout differs per data slice
    return model, n_params


def _parallelize(cfg: Config, inner: nn.Module, d: Dist) -> DeviceMesh:
    """Apply the GPT's TP plan on the world mesh's ``tp`` dim; return the data-parallel
    slice fsdp_lite shards over: ``dp``, or (``fsdp.shard_size``) ``replicate x shard``."""
    shard = cfg.fsdp.shard_size or d.dp_size
    shape, names = (d.dp_size // shard, shard, d.tp), ("replicate", "shard", "tp")
    d.mesh = init_device_mesh(d.device.type, shape, mesh_dim_names=names)
    parallelize_gpt(inner, d.mesh["tp"])
    if shard == d.dp_size:
        return d.mesh["shard"]
    return d.mesh["replicate", "shard"]


def build_optimizers(cfg: Config, model: fsdp_lite.FSDPModule) -> list[torch.optim.Optimizer]:
    """AdamW over every parameter, or (``optim.name: muon``) Muon over this rank's whole
    2-D matrices of the transformer blocks and AdamW over the rest, at their peak rates
    (``optim.muon_lr``, ``train.lr``)."""
    t, o = cfg.train, cfg.optim
    named = list(model.named_parameters())
    mats: list[nn.Parameter] = []
    if o.name == "muon":
        blocks = _block_types(cfg, model)
        inside = [n + "." for n, m in model.named_modules() if isinstance(m, blocks)]
        mats = [p for n, p in named if p.ndim == 2 and any(n.startswith(i) for i in inside)]
    rest = [p for _, p in named if all(p is not m for m in mats)]
    # Param-group dicts: torch refuses an empty parameter list, and a rank may own no
    # matrix (or nothing else); every rank must build the same optimizers all the same.
    opts: list[torch.optim.Optimizer] = []
    if o.name == "muon":
        opts.append(torch.optim.Muon([{"params": mats}], lr=o.muon_lr, weight_decay=t.weight_decay))
    opts.append(torch.optim.AdamW([{"params": rest}], lr=t.lr, weight_decay=t.weight_decay))
    for opt in opts:
        if cfg.fsdp.offload == "ssd":  # moments in the shards' files too
            fsdp_lite.offload_optimizer_state(opt, model)
    return opts


def _block_types(cfg: Config, model: nn.Module) -> tuple[type[nn.Module], ...]:
    if cfg.model.hf is None:
        return (Block,)

    return layer_classes(model)


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr``."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


# -- Hugging Face models (model.hf) ------------------------------------------------


@dataclass
class HFSource:
    """Where the HF model comes from: ``config`` is a file or a directory for
    ``AutoConfig.from_pretrained``; ``weights``/``tokenizer_dir``: None when absent."""

    config: Path
    weights: Path | None
    tokenizer_dir: Path | None


def hf_source(path: str) -> HFSource:
    p = Path(path)
    if p.is_file():
        return HFSource(p, None, None)
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"model.hf={path!r} must be an HF config .json file or a directory holding "
            "config.json (make one with transformers' XConfig(...).save_pretrained(dir))"
        )
    weights = p if any(p.glob("*.safetensors")) else None
    return HFSource(p, weights, p)


def load_hf_config(src: HFSource) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(src.config))
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf: {src.config} is not a readable HF config: {e}") from e


def load_tokenizer(src: HFSource) -> Any | None:
    """The directory's tokenizer, or None (the script then uses characters as tokens)."""
    if src.tokenizer_dir is None:
        return None
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((src.tokenizer_dir / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(src.tokenizer_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf: cannot load the tokenizer in {src.tokenizer_dir}: {e}") from e


def check_vocab(cfg: Config, hf_config: Any, vocab_size: int, max_id: int, tokenizer: Any) -> None:
    """The model must embed every token id of the corpus and see ``block_size`` positions."""
    model_vocab = getattr(hf_config, "vocab_size", None)
    if model_vocab is not None and tokenizer is None and model_vocab < vocab_size:
        raise ConfigError(
            f"model.hf: the model's vocab_size {model_vocab} is smaller than the character "
            f"vocabulary of the corpus ({vocab_size}); set vocab_size >= {vocab_size} in "
            f"{cfg.model.hf}'s config.json or add a tokenizer to that directory"
        )
    if model_vocab is not None and max_id >= model_vocab:
        raise ConfigError(
            f"model.hf: the tokenizer produces ids up to {max_id} but the model's vocab_size "
            f"is {model_vocab}; use a model whose embedding covers the tokenizer"
        )
    positions = getattr(hf_config, "max_position_embeddings", None)
    if positions is not None and cfg.model.block_size > positions:
        raise ConfigError(
            f"model.block_size={cfg.model.block_size} exceeds the model's "
            f"max_position_embeddings {positions}; lower model.block_size"
        )


def build_hf_model(cfg: Config) -> nn.Module:
    """The unwrapped causal LM in fp32 (the caller seeds torch alike on every rank)."""
    from transformers import AutoModelForCausalLM

    src = hf_source(cfg.model.hf)
    if src.weights is not None:
        return AutoModelForCausalLM.from_pretrained(str(src.weights), dtype=torch.float32)
    return AutoModelForCausalLM.from_config(load_hf_config(src), dtype=torch.float32)


def layer_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The HF model's transformer layer classes (``_no_split_modules``): one unit each."""
    return fsdp_lite.wrap.transformer_layers(model)


def export_hf(out: Path, model: fsdp_lite.FSDPModule, tokenizer: Any | None, rank: int) -> Path:
    """Write the final model as an HF checkpoint in ``out`` (collective: every rank calls
    it), plus the tokenizer if there is one, so ``AutoModelForCausalLM.from_pretrained(out)``
    loads it."""
    fsdp_lite.save_pretrained(model, out)
    if tokenizer is not None and rank == 0:
        tokenizer.save_pretrained(str(out))
    return out


# -- checkpoints and resume --------------------------------------------------------


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


def save_checkpoint(
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


def restore_checkpoint(
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
