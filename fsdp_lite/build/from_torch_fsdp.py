"""What users of PyTorch's FSDP1 (``FullyShardedDataParallel``) and FSDP2 (``fully_shard``)
bring to ``FSDPModule``, refused with the fsdp_lite call that does the same.

Three kinds, each checked before anything is built or changed:

- keyword arguments fsdp_lite does not take (``sharding_strategy=``, ``cpu_offload=``,
  ``mp_policy=``, ``device_id=``, ...): ``check_keywords``;
- torch's option objects where fsdp_lite takes its own (FSDP1's ``MixedPrecision`` and
  ``CPUOffload``, FSDP2's ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy``, a
  ``BackwardPrefetch``, FSDP1's wrap policies): ``check_options``, whose message spells
  the replacement with the user's own values;
- methods of FSDP1 and FSDP2 that ``FSDPModule`` lacks (``unshard()``,
  ``set_is_last_backward``, ``FSDP.optim_state_dict``, ...): ``REFUSED_METHODS``, read by
  ``FSDPModule`` on a failed attribute lookup (class or instance), so ``hasattr`` stays
  False and the error says what to call instead.

Names fsdp_lite shares with them (``mixed_precision``, ``sync_module_states``,
``param_init_fn``, ``use_orig_params``, ``ignored_modules``, ``no_sync``,
``set_requires_gradient_sync``, ``summon_full_params``, ...) are not here: they work.
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.fsdp import wrap as torch_wrap

_PREFETCH = (
    "fsdp_lite prefetches by default: prefetch=fsdp_lite.PrefetchPolicy() gathers one unit "
    "ahead in forward and backward (FSDP1's forward_prefetch and BACKWARD_PRE) and keeps at "
    "most max_in_flight=2 gathers in flight, which bounds memory as limit_all_gathers does; "
    "to choose, wrap with prefetch=fsdp_lite.PrefetchPolicy(forward=..., backward=..., "
    "max_in_flight=...), or prefetch=None to turn it off"
)
_SHARDED_CHECKPOINT = (
    "fsdp_lite.save_checkpoint(path, model, optimizer) and fsdp_lite.load_checkpoint(path, "
    "model, optimizer) write and read model and optimizer state sharded (DCP), at any world size"
)
_NO_COMM_HOOKS = (
    "fsdp_lite has no hooks or options for its collectives (each unit gathers into, and "
    "reduce-scatters out of, one flat buffer per dtype): remove the call"
)
_DIVIDE = (
    "fsdp_lite averages gradients over the data-parallel ranks (those of its process group "
    "or mesh, replicas included); for another normalization, scale the loss"
)

# FSDP1 / FSDP2 method -> what to do with fsdp_lite instead (a constant table).
REFUSED_METHODS: Mapping[str, str] = MappingProxyType({
    # FSDP2's FSDPModule
    "unshard": "read or write full parameters inside `with model.summon_full_params():`; a "
    "forward gathers what it needs by itself (and prefetches: fsdp_lite.PrefetchPolicy)",
    "reshard": "full parameters are freed when `with model.summon_full_params():` ends and "
    "after each unit's forward and backward (reshard_after_forward)",
    "set_is_last_backward": "call model.set_requires_gradient_sync(False) before the "
    "backwards of the micro-batches before the last, and True before the last (or run them "
    "under `with model.no_sync():`)",
    "set_modules_to_forward_prefetch": _PREFETCH,
    "set_modules_to_backward_prefetch": _PREFETCH,
    "set_requires_all_reduce": "with hybrid sharding, model.set_requires_gradient_sync(False) "
    "skips both the reduce-scatter and the replicas' all-reduce for the micro-batches before "
    "the last; fsdp_lite has no reduce-scatter-only accumulation",
    "set_gradient_divide_factor": _DIVIDE,
    "set_reduce_scatter_divide_factor": _DIVIDE,
    "set_force_sum_reduction_for_comms": _NO_COMM_HOOKS,
    "set_post_optim_event": "not needed: a unit's all-gather waits for the current stream, "
    "where the optimizer step ran; remove the call",
    "set_unshard_in_backward": "fsdp_lite gathers again in backward every unit that freed its "
    "parameters after forward; to skip that gather keep the unit gathered instead "
    "(unit.set_reshard_after_forward(False, recurse=False))",
    "set_reduce_scatter_unused_params": "a parameter that got no gradient is reduced as zeros "
    "with the rest of its unit's flat gradient: remove the call",
    "set_allocate_memory_from_process_group_for_comm": _NO_COMM_HOOKS,
    "set_symm_mem_for_comm": _NO_COMM_HOOKS,
    "set_custom_all_gather": _NO_COMM_HOOKS,
    "set_custom_reduce_scatter": _NO_COMM_HOOKS,
    "set_all_reduce_hook": _NO_COMM_HOOKS,
    "set_reduce_scatter_max_input_buffers": _NO_COMM_HOOKS,
    "reset_iter_state": "call model.reset_training_state() on the root: the same recovery "
    "after an exception in forward or backward",
    # FSDP1's FullyShardedDataParallel
    "check_is_root": "the outermost FSDPModule of a tree is its root (it takes its units at "
    "its first forward)",
    "fsdp_modules": "[m for m in model.modules() if isinstance(m, fsdp_lite.FSDPModule)]",
    "register_comm_hook": _NO_COMM_HOOKS,
    "full_optim_state_dict": "fsdp_lite.full_optim_state_dict(model, optimizer) (a full state "
    "dict keyed by parameter names, on rank 0); or " + _SHARDED_CHECKPOINT,
    "optim_state_dict": "fsdp_lite.full_optim_state_dict(model, optimizer); or "
    + _SHARDED_CHECKPOINT,
    "sharded_optim_state_dict": _SHARDED_CHECKPOINT,
    "optim_state_dict_to_load": "fsdp_lite.load_full_optim_state_dict(model, optimizer, "
    "state) loads a full, name-keyed optimizer state dict at any world size; or "
    + _SHARDED_CHECKPOINT,
    "shard_full_optim_state_dict": "fsdp_lite.load_full_optim_state_dict(model, optimizer, state)",
    "scatter_full_optim_state_dict": "fsdp_lite.load_full_optim_state_dict(model, optimizer, "
    "state, rank0_only=True) (only rank 0's dict is read)",
    "flatten_sharded_optim_state_dict": _SHARDED_CHECKPOINT,
    "rekey_optim_state_dict": "not needed: fsdp_lite's optimizer state dicts are keyed by "
    "parameter names already",
})


class Refused:
    """A class attribute for a name of ``REFUSED_METHODS``: reading it, on the class
    (``FSDPModule.optim_state_dict``) or an instance, raises ``AttributeError`` saying what
    to do instead."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        raise refused_method(self.name)


def add_refused_methods(cls: type) -> None:
    """Give ``cls`` (``FSDPModule``) a ``Refused`` attribute for each name of
    ``REFUSED_METHODS``, so reading one on the class says what to call instead (an
    instance's ``__getattr__`` raises the same ``refused_method`` error)."""
    for name in REFUSED_METHODS:
        setattr(cls, name, Refused(name))


def refused_method(name: str) -> AttributeError:
    return AttributeError(
        f"fsdp_lite.FSDPModule has no {name}() (PyTorch FSDP's): {REFUSED_METHODS[name]}"
    )


def _sharding_strategy(value: object) -> str:
    s = torch_fsdp.ShardingStrategy
    hybrid = (
        "process_group=fsdp_lite.hybrid_groups(ranks_per_node) (or mesh=world['replicate', "
        "'shard'])"
    )
    advice = {
        s.FULL_SHARD: "it is the default: drop the argument",
        s.SHARD_GRAD_OP: "pass reshard_after_forward=False",
        s.NO_SHARD: "nothing would be sharded: use torch.nn.parallel.DistributedDataParallel",
        s.HYBRID_SHARD: f"pass {hybrid}",
        s._HYBRID_SHARD_ZERO2: f"pass {hybrid} and reshard_after_forward=False",
    }
    return advice.get(value, "drop it: fsdp_lite fully shards by default")  # type: ignore[arg-type]


_OFFLOAD = "to offload, pass offload=fsdp_lite.CPUOffload(); else drop it"
_MIXED_PRECISION = (
    "to compute in low precision, pass mixed_precision=fsdp_lite.MixedPrecision("
    "param_dtype=..., reduce_dtype=...); else drop it"
)

# FSDP1 / FSDP2 keyword -> what to do (a function of the value where it decides).
_KEYWORDS: Mapping[str, Callable[[Any], str]] = MappingProxyType({
    "sharding_strategy": _sharding_strategy,
    "cpu_offload": lambda v: _offload(v) or _OFFLOAD,
    "offload_policy": lambda v: _offload(v) or _OFFLOAD,
    "mp_policy": lambda v: _mixed_precision(v) or _MIXED_PRECISION,
    "backward_prefetch": lambda v: _PREFETCH,
    "forward_prefetch": lambda v: _PREFETCH,
    "limit_all_gathers": lambda v: _PREFETCH,
    "device_id": lambda v: f"pass device={v!r}",
    "ignored_states": lambda v: (
        "pass ignored_modules=[...] (modules) or ignored_params=[...] (parameters)"
    ),
    "shard_placement_fn": lambda v: (
        "fsdp_lite shards each unit's parameters as one flat "
        "buffer split evenly over the ranks; optimizer_params='whole' gives each rank whole "
        "parameters instead (for Muon)"
    ),
})


def check_keywords(keywords: Mapping[str, Any]) -> None:
    """Refuse keyword arguments ``FSDPModule`` does not take, as Python would, saying what
    FSDP1's or FSDP2's name becomes in fsdp_lite."""
    for name, value in keywords.items():
        if name not in _KEYWORDS:
            raise TypeError(f"FSDPModule() got an unexpected keyword argument {name!r}")
        raise TypeError(
            f"FSDPModule() does not take {name}= (PyTorch FSDP's): {_KEYWORDS[name](value)}"
        )


def _mixed_precision(mp: object) -> str | None:
    """The fsdp_lite ``MixedPrecision`` that does what FSDP1's ``MixedPrecision`` or
    FSDP2's ``MixedPrecisionPolicy`` ``mp`` does; None for anything else. Both reduce in
    ``param_dtype`` when ``reduce_dtype`` is None; fsdp_lite's default reduces in fp32, so
    the replacement names the reduce dtype."""
    if isinstance(mp, torch_fsdp.MixedPrecision):
        cast, buffers = mp.cast_root_forward_inputs, mp.buffer_dtype
    elif isinstance(mp, torch_fsdp.MixedPrecisionPolicy):
        cast, buffers = mp.cast_forward_inputs, None
    else:
        return None
    if mp.param_dtype is None and mp.reduce_dtype is None and buffers is None:
        return "it changes no dtype: drop it (mixed_precision=None)"
    param = mp.param_dtype or torch.float32
    reduce = mp.reduce_dtype or param
    args = [f"param_dtype={param}", f"reduce_dtype={reduce}"]
    if buffers is not None:
        args.append(f"buffer_dtype={buffers}")
    if not cast:
        args.append("cast_inputs=False")
    extra = ""
    if getattr(mp, "output_dtype", None) is not None:
        extra = f"; outputs come in param_dtype: cast them to {mp.output_dtype} yourself"
    if getattr(mp, "keep_low_precision_grads", False):
        extra = "; gradients always accumulate into the fp32 shard grads"
    return f"pass mixed_precision=fsdp_lite.MixedPrecision({', '.join(args)}){extra}"


def _offload(offload: object) -> str | None:
    """What FSDP1's ``CPUOffload`` or FSDP2's offload policy becomes; None for others."""
    if isinstance(offload, torch_fsdp.CPUOffload):
        if not offload.offload_params:
            return "it offloads nothing: drop it (offload=None)"
        return "pass offload=fsdp_lite.CPUOffload()"
    if isinstance(offload, torch_fsdp.CPUOffloadPolicy):
        return f"pass offload=fsdp_lite.CPUOffload(pin_memory={offload.pin_memory})"
    if isinstance(offload, torch_fsdp.OffloadPolicy):
        return "it offloads nothing: drop it (offload=None)"
    return None


def _classes(classes: Any) -> str:
    return ", ".join(getattr(c, "__name__", repr(c)) for c in classes or ())


def _policy(policy: object) -> str | None:
    """The fsdp_lite policy that does what FSDP1's auto-wrap policy ``policy`` does; None
    for anything else (an fsdp_lite policy: ``policy(module) -> bool``)."""
    if isinstance(policy, torch_wrap.ModuleWrapPolicy):
        return f"pass auto_wrap_policy=fsdp_lite.wrap.by_type({_classes(policy._module_classes)})"
    if isinstance(policy, torch_wrap.CustomPolicy):
        return (
            "pass its lambda_fn as auto_wrap_policy (fsdp_lite's policies are lambda_fn(module) "
            "-> bool); a module that needs other arguments than the rest: wrap it yourself "
            "first, FSDPModule(submodule, ...), then the whole model"
        )
    if isinstance(policy, torch_wrap._Policy):
        return "pass auto_wrap_policy=fn, where fn(module) -> bool picks the units"
    fn, kw = policy, {}
    if isinstance(policy, functools.partial):
        fn, kw = policy.func, policy.keywords
    if fn is torch_wrap.transformer_auto_wrap_policy:
        return (
            "pass auto_wrap_policy=fsdp_lite.wrap.by_type("
            f"{_classes(kw.get('transformer_layer_cls'))})"
        )
    if fn is torch_wrap.size_based_auto_wrap_policy:
        return (
            f"pass auto_wrap_policy=fsdp_lite.wrap.by_size({int(kw.get('min_num_params', 1e8))})"
            " (it counts, as FSDP1's nonwrapped_numel, the parameters not in a nested unit)"
        )
    if fn is torch_wrap.lambda_auto_wrap_policy:
        return "pass its lambda_fn itself: auto_wrap_policy=lambda_fn (lambda_fn(module) -> bool)"
    try:
        names = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if "recurse" in names or "nonwrapped_numel" in names:
        return (
            "fsdp_lite's policies take the module alone, policy(module) -> bool, asked "
            "bottom-up (children first): pass a function of the module, "
            "fsdp_lite.wrap.by_type(Block) or fsdp_lite.wrap.by_size(min_num_params)"
        )
    return None


def check_reshard_after_forward(value: object) -> None:
    """``True``, ``False`` or ``None``; FSDP2's int (reshard to groups of that many ranks)
    is refused rather than read as ``True``."""
    if value is None or isinstance(value, bool):
        return
    raise TypeError(
        f"reshard_after_forward must be True, False or None, got {value!r}: fsdp_lite has no "
        "FSDP2-style resharding to a smaller group after forward; pass True (free after "
        "forward, gather again over every rank in backward) or False (keep the full "
        "parameters until backward)"
    )


def check_options(
    auto_wrap_policy: object,
    mixed_precision: object,
    offload: object,
    prefetch: object,
    reshard_after_forward: object = None,
) -> None:
    """Refuse PyTorch FSDP's option objects (and FSDP1's wrap policies) passed for
    fsdp_lite's, naming the fsdp_lite object that does the same, and FSDP2's int
    ``reshard_after_forward``."""
    check_reshard_after_forward(reshard_after_forward)
    found = [
        ("auto_wrap_policy", auto_wrap_policy, _policy(auto_wrap_policy)),
        ("mixed_precision", mixed_precision, _mixed_precision(mixed_precision)),
        ("offload", offload, _offload(offload)),
    ]
    if isinstance(prefetch, torch_fsdp.BackwardPrefetch):
        found.append(("prefetch", prefetch, _PREFETCH))
    for name, value, advice in found:
        if advice is not None:
            raise TypeError(f"{name}: {_describe(value)} is PyTorch FSDP's: {advice}")


def _describe(value: object) -> str:
    """``value`` in a few words: an enum member, a partial's function, else its type."""
    if isinstance(value, functools.partial):
        return f"functools.partial({getattr(value.func, '__name__', value.func)}, ...)"
    if isinstance(value, enum.Enum):
        return str(value)
    return getattr(value, "__name__", None) or f"{type(value).__name__}(...)"
