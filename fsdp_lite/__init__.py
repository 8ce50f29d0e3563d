"""fsdp_lite: fully sharded data parallel training for PyTorch, in a few small files."""

from fsdp_lite import wrap
from fsdp_lite.accounting import comm_stats, reset_comm_stats, reset_stats, stats
from fsdp_lite.api import MixedPrecision, PrefetchPolicy
from fsdp_lite.checkpoint import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
    make_viewless_tensor,
)
from fsdp_lite.collectives import (
    DivergenceError,
    PeerError,
    hybrid_groups,
    set_divergence_check,
)
from fsdp_lite.compile import compile_blocks
from fsdp_lite.fsdp import FSDPModule
from fsdp_lite.grad_scaler import ShardedGradScaler
from fsdp_lite.hf_checkpoint import load_pretrained, save_pretrained
from fsdp_lite.offload import CPUOffload, SSDOffload, offload_optimizer_state
from fsdp_lite.offload_model import OffloadModel
from fsdp_lite.optim_state import full_optim_state_dict, load_full_optim_state_dict
from fsdp_lite.planner import MemoryEstimate, Plan, estimate_memory, plan
from fsdp_lite.save_load import CheckpointError, load_checkpoint, save_checkpoint
from fsdp_lite.state import FSDPStateError, TrainingState

__all__ = [
    "DivergenceError",
    "PeerError",
    "Plan",
    "hybrid_groups",
    "set_divergence_check",
    "CPUOffload",
    "SSDOffload",
    "offload_optimizer_state",
    "CheckpointError",
    "FSDPModule",
    "FSDPStateError",
    "MemoryEstimate",
    "MixedPrecision",
    "OffloadModel",
    "PrefetchPolicy",
    "ShardedGradScaler",
    "TrainingState",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
    "comm_stats",
    "compile_blocks",
    "estimate_memory",
    "full_optim_state_dict",
    "load_checkpoint",
    "load_full_optim_state_dict",
    "load_pretrained",
    "make_viewless_tensor",
    "plan",
    "reset_comm_stats",
    "reset_stats",
    "save_checkpoint",
    "save_pretrained",
    "stats",
    "wrap",
]
__version__ = "0.1.0"
