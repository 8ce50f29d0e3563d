"""The optimizer misuse check: before an optimizer's first step, refuse what would train
silently wrong.

- An optimizer built over the module's parameters *before* wrapping would step tensors
  nothing uses any more. The originals are emptied when flattened (so they hold no
  memory) and marked, and an optimizer holding one is refused -- unless the originals
  live on as orig params (optimizer_params 'pieces' / 'whole', ``optim_view.py``).
- A matrix optimizer (Muon, Shampoo, SOAP) holding pieces of parameters cut at numel/W.
- Plain trainable parameters beside shards of a multi-rank unit (only blocks were
  wrapped): nothing averages their gradients.
- fp16 shards of a multi-rank unit stepped without ``fsdp_lite.ShardedGradScaler`` having
  unscaled them: a stock ``GradScaler`` skips a step on one rank only (a warning).
- torch's distributed state-dict helpers (``get_state_dict``, ``get_optimizer_state_dict``,
  ``set_state_dict``, ...; FSDP2's checkpoint habit) on an optimizer stepping shards: they
  take each rank's shards for whole tensors under one name, so ``dcp.save`` would keep one
  rank's and the checkpoint would not load. The optimizer gets state-dict pre-hooks that
  refuse those helpers (only them: a rank's own ``optimizer.state_dict()`` stays) and name
  ``fsdp_lite.save_checkpoint`` / ``load_checkpoint``, which write and read FSDP2's layout.

One global step pre-hook (torch offers none per parameter), installed once per process by
the first wrap (``install_check``); it checks each optimizer once, marking it, so it costs
nothing after an optimizer's first step, and nothing beyond a dictionary lookup for
optimizers holding no fsdp_lite parameter.
"""

from __future__ import annotations

import gc
import sys
import warnings

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_lite.core.optim_view import cut_from, shard_compute_dtype, shard_ranks, unaveraged

# Optimizers (by class name, along the class's MRO) that step whole matrices: they must
# not see a partial piece of a parameter (optimizer_params='pieces').
MATRIX_OPTIMIZERS = frozenset({"Muon", "Shampoo", "DistributedShampoo", "SOAP"})
# In an original parameter's __dict__ once flattened: its name, for the error.
_FLATTENED_ATTR = "_fsdp_lite_flattened"
# In an optimizer's __dict__: checked (its first step ran the checks).
_CHECKED_ATTR = "_fsdp_lite_checked"
# In an optimizer's __dict__: a ShardedGradScaler made the ranks agree on its overflows.
_AGREED_ATTR = "_fsdp_lite_overflow_agreed"
# The handle of the one global hook: a process installs it once, by nature of the hook.
_HOOK: list = []


def install_check() -> None:
    """Install the one global optimizer step pre-hook that runs the checks, once per
    process (every wrap calls it; the first installs it)."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


def empty_flattened(p: nn.Parameter, name: str) -> None:
    """``p`` was flattened into a shard: empty it and mark it with its ``name``, so an
    optimizer holding it is refused (see the module docstring)."""
    p.__dict__[_FLATTENED_ATTR] = name
    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    p.grad = None


def flattened_as(p: nn.Parameter) -> str | None:
    """The name ``p`` had when a unit flattened it, or ``None``."""
    return p.__dict__.get(_FLATTENED_ATTR)


def mark_overflow_agreed(optimizer: torch.optim.Optimizer) -> None:
    """``ShardedGradScaler`` made every rank agree on ``optimizer``'s overflows."""
    optimizer.__dict__[_AGREED_ATTR] = True


def loose_parameters(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The trainable ``params`` whose gradients nothing averages across ranks
    (``unaveraged``). Only when some are found does it scan the process for the
    ``DistributedDataParallel`` modules that may average them (the error path only)."""
    loose = [params[i] for i in unaveraged(params, [])]
    if loose:
        ddp = [o for o in gc.get_objects() if isinstance(o, nn.parallel.DistributedDataParallel)]
        loose = [loose[i] for i in unaveraged(loose, ddp)]
    return loose


def shapes_of(params: list[nn.Parameter]) -> str:
    """The first few shapes, for an error message."""
    shown = ", ".join(str(tuple(p.shape)) for p in params[:4])
    return shown + (", ..." if len(params) > 4 else "")


def _check_optimizer(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    if optimizer.__dict__.get(_CHECKED_ATTR):
        return
    optimizer.__dict__[_CHECKED_ATTR] = True
    params = [p for group in optimizer.param_groups for p in group["params"]]
    _refuse_flattened(optimizer, params)
    _refuse_cut_matrices(optimizer, params)
    marks = [m for p in params if (m := shard_ranks(p)) is not None]
    if marks:
        optimizer.register_state_dict_pre_hook(_refuse_torch_state_dict_helpers)
        optimizer.register_load_state_dict_pre_hook(_refuse_torch_state_dict_helpers)
    ranks = max((world * replicas for world, replicas in marks), default=1)
    if ranks > 1:
        _refuse_unaveraged(optimizer, params, ranks)
        _warn_fp16_without_sharded_scaler(optimizer, params)


def _refuse_flattened(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    for p in params:
        name = flattened_as(p)
        if name is not None and shard_ranks(p) is None:  # not kept as an orig param
            raise RuntimeError(
                f"this {type(optimizer).__name__} holds '{name}', an original parameter "
                "that fsdp_lite.FSDPModule flattened into a shard: it would step a tensor "
                "nothing uses. Build the optimizer after wrapping, from model.parameters()"
            )


def _refuse_cut_matrices(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    cut = [p for p in params if cut_from(p) is not None]
    matrix = [c.__name__ for c in type(optimizer).__mro__ if c.__name__ in MATRIX_OPTIMIZERS]
    if cut and matrix:
        raise RuntimeError(
            f"this {type(optimizer).__name__} (a {matrix[0]}: it needs whole matrices) holds "
            f"{len(cut)} piece(s) of parameters cut at numel/W (e.g. one of shape "
            f"{tuple(cut_from(cut[0]))}, held here as {tuple(cut[0].shape)}): "
            "optimizer_params='pieces' cuts each flat param evenly, across parameter boundaries. "
            "Wrap with FSDPModule(..., optimizer_params='whole'): every rank then owns whole "
            "parameters, shaped"
        )


def _refuse_unaveraged(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], ranks: int
) -> None:
    loose = loose_parameters(params)
    if loose:
        raise RuntimeError(
            f"this {type(optimizer).__name__} holds {len(loose)} trainable parameter(s) of no "
            f"fsdp_lite unit (shapes {shapes_of(loose)}) beside "
            f"shards averaged over {ranks} ranks: nothing averages those parameters' "
            "gradients, so the ranks would silently diverge. Wrap the whole model -- "
            "FSDPModule(model, auto_wrap_policy=...) still makes each block its own unit"
        )


def _warn_fp16_without_sharded_scaler(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter]
) -> None:
    """fp16 compute needs loss scaling, and loss scaling over shards needs every rank to
    agree on each overflow: ``ShardedGradScaler`` marks the optimizers it unscaled (before
    their step, so before this check)."""
    fp16 = any(shard_compute_dtype(p) == torch.float16 for p in params)
    if fp16 and not optimizer.__dict__.get(_AGREED_ATTR):
        warnings.warn(
            f"fsdp_lite: {type(optimizer).__name__} steps fp16 fsdp_lite shards of a "
            "multi-rank unit, and no fsdp_lite.ShardedGradScaler unscaled them. A stock "
            "torch.amp.GradScaler on each rank checks only its own shard grads for inf/nan, "
            "so the ranks skip different steps and their loss scales (and weights) drift "
            "apart. Use fsdp_lite.ShardedGradScaler, a drop-in replacement whose ranks "
            "agree on every overflow.",
            UserWarning,
            stacklevel=3,
        )


# The module of torch's distributed state-dict helpers (get_state_dict, set_state_dict, ...).
_TORCH_STATE_DICT_HELPERS = "torch.distributed.checkpoint.state_dict"


def _refuse_torch_state_dict_helpers(optimizer: torch.optim.Optimizer, *args: object) -> None:
    """A state-dict pre-hook (saving and loading) of an optimizer stepping fsdp_lite shards:
    raises when one of torch's distributed state-dict helpers called it."""
    frame, helper = sys._getframe(1), None
    while frame is not None:
        if frame.f_globals.get("__name__") == _TORCH_STATE_DICT_HELPERS:
            helper = frame.f_code.co_name  # the outermost: the one the user called
        frame = frame.f_back
    if helper is None:
        return
    raise RuntimeError(
        f"torch.distributed.checkpoint.state_dict.{helper} cannot read or "
        f"write the state of this {type(optimizer).__name__}: it steps fsdp_lite shards, which "
        "torch's helpers take for whole tensors (DCP would save one rank's shard under each "
        "name, and the checkpoint would not load). Use fsdp_lite.save_checkpoint(path, "
        "model, optimizer) and fsdp_lite.load_checkpoint(path, model, optimizer): they write "
        "the layout FSDP2's get_state_dict + dcp.save writes (FSDP2 resumes from it) and read "
        "FSDP2's and torchtitan's checkpoints, at any world size"
    )
