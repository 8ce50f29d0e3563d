"""fsdp_lite: fully sharded data parallel training for PyTorch, in a few small files.

The package by layer (imports point down: add-ons use the core, never the reverse):

- ``core/``: the step -- ``root.py``, ``schedule.py``, ``unit.py``, ``flat_param.py``,
  ``collectives.py`` -- and wrap-time work, policies, accounting;
- ``fsdp.py``: ``FSDPModule``, the wrapper users hold, built from the core and offering
  the add-ons' state dicts and ``summon_full_params`` as methods;
- ``addons/``: offload, activation checkpointing, compiled blocks, state dicts and
  checkpoints (saving and loading), Hugging Face files, the grad scaler, OffloadModel;
- ``planner/``: the memory planner, which wraps models and so sits above ``fsdp.py``;
- ``testing/``: the harness the tests and benchmarks share.
"""

import warnings
from typing import Any

from fsdp_lite.addons.activation_checkpointing import (
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from fsdp_lite.addons.checkpoints import CheckpointError, load_checkpoint, save_checkpoint
from fsdp_lite.addons.compile import compile_blocks
from fsdp_lite.addons.grad_scaler import ShardedGradScaler
from fsdp_lite.addons.hugging_face import hf_tp_plan, load_pretrained, save_pretrained
from fsdp_lite.addons.offload import CPUOffload, SSDOffload, offload_optimizer_state
from fsdp_lite.addons.offload_model import OffloadModel
from fsdp_lite.addons.optim_state import full_optim_state_dict, load_full_optim_state_dict
from fsdp_lite.build import deferred_init, wrap
from fsdp_lite.core.collectives import DivergenceError, PeerError, hybrid_groups
from fsdp_lite.core.policies import MixedPrecision, PrefetchPolicy
from fsdp_lite.core.state import FSDPStateError
from fsdp_lite.fsdp import FSDPModule, reset_stats, stats
from fsdp_lite.planner.estimate import estimate_memory, plan

__all__ = [
    # wrap and train
    "FSDPModule",
    "MixedPrecision",
    "PrefetchPolicy",
    "wrap",
    "deferred_init",
    "hybrid_groups",
    "stats",
    "reset_stats",
    # errors
    "FSDPStateError",
    "DivergenceError",
    "PeerError",
    "CheckpointError",
    # add-ons
    "CPUOffload",
    "SSDOffload",
    "offload_optimizer_state",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
    "CheckpointWrapper",
    "compile_blocks",
    "save_checkpoint",
    "load_checkpoint",
    "full_optim_state_dict",
    "load_full_optim_state_dict",
    "save_pretrained",
    "load_pretrained",
    "hf_tp_plan",
    "ShardedGradScaler",
    "OffloadModel",
    "estimate_memory",
    "plan",
]
__version__ = "0.1.0"

# Names that left the top level, still answered (with a DeprecationWarning) from their home.
_MOVED = {
    "make_viewless_tensor": "fsdp_lite.addons.activation_checkpointing",
    "set_divergence_check": "fsdp_lite.core.divergence",
    "TrainingState": "fsdp_lite.core.state",
    "Plan": "fsdp_lite.planner.estimate",
    "MemoryEstimate": "fsdp_lite.planner.estimate",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib

        home = _MOVED[name]
        warnings.warn(
            f"fsdp_lite.{name} moved to {home}.{name}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'fsdp_lite' has no attribute {name!r}")
