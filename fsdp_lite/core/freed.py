"""What a parameter location holds while its unit's full buffer is freed.

[Note: what a module's parameter attribute is between steps]
While a unit's full buffer is allocated, each original parameter location holds a view of
it. Whenever the buffer is freed (and before the first gather) each location holds a
:class:`FreedParameter` instead: shape, dtype and device answer, and any computation
raises an error naming ``summon_full_params``, never reads freed storage. A full buffer
kept from a forward (the root's, ``reshard_after_forward=False``) lives until that forward's
backward ends or the next root forward begins (``Root._free_kept``): it is never gathered
"again if stale", so nothing needs to tell whether the shard changed.
"""

from __future__ import annotations

import types
from typing import Any

import torch

# A freed parameter's device properties, answered for its real device (a constant).
_DEVICE_FLAGS = types.MappingProxyType(
    {
        torch._C.TensorBase.is_meta: "meta",
        torch._C.TensorBase.is_cuda: "cuda",
        torch._C.TensorBase.is_cpu: "cpu",
    }
)


class FreedParameter(torch.Tensor):
    """What a parameter location holds while its unit's full buffer is freed (see Note):
    shape, dtype and device answer; any computation raises ``message``."""

    message = "{op}"  # the error, with ``{op}`` for the function that was called
    real_device = torch.device("cpu")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        attribute = getattr(func, "__self__", None)  # a property's descriptor, for its getter
        if attribute is torch._C.TensorBase.device:
            return args[0].real_device
        if attribute in _DEVICE_FLAGS:  # what the real device answers, not the meta tensor
            return args[0].real_device.type == _DEVICE_FLAGS[attribute]
        if attribute is torch._C.TensorBase.data:  # a write through it would reach nothing
            raise RuntimeError(args[0].message.format(op=".data"))
        if getattr(func, "__name__", "") == "__get__" or func is torch.Tensor.__repr__:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        freed = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, FreedParameter)]
        message = freed[0].message if freed else cls.message
        raise RuntimeError(message.format(op=getattr(func, "__name__", func)))


def freed_parameter(
    shape: torch.Size, dtype: torch.dtype, device: torch.device, message: str
) -> FreedParameter:
    t = torch.Tensor._make_subclass(FreedParameter, torch.empty(shape, dtype=dtype, device="meta"))
    t.message, t.real_device = message, device
    return t


def between_steps_message(name: str, unit: str) -> str:
    return (
        f"fsdp_lite: {{op}} on parameter '{name}' of unit {unit}, whose full value exists "
        "on no rank here (between steps each rank keeps only its 1/W fp32 shard, which "
        "model.parameters() yields; full parameters exist only inside the unit's forward and "
        "backward). Read or change full parameters inside `with model.summon_full_params():` "
        "or through model.state_dict() / load_state_dict(); set requires_grad on what "
        "model.parameters() yields."
    )
