"""The training script's setup: process group, the wrapped model, schedule, loss scaling.

``build_model`` (the GPT, or a Hugging Face causal LM with ``model.hf``: see ``train_hf``)
is the one place that composes fsdp_lite's features, in torchtitan's order: activation
checkpointing per block, then a unit per block (or by size), then the root, with the
offload, prefetch, mixed-precision and hybrid-sharding policies the config picks.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from train_config import Config, ConfigError, TrainConfig

import fsdp_lite
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
        import train_hf  # imports transformers

        model = train_hf.build_hf_model(cfg)
        return model, train_hf.layer_classes(model)
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
    import train_hf

    return train_hf.layer_classes(model)


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr``."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)
