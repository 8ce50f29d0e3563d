"""Where a flat param's shard and shard grad live between uses. The default home, the
compute device, is here; the offload homes (CPU memory, files) extend it in
``addons/offload.py``. A home is handed the shard ``nn.Parameter`` itself (whose
``.data`` it may move, never the object) and knows nothing of flat params.

Its eight methods, and who calls them:

    place               the flat param, once at wrap time
    shard_for_gather    the flat param, before each gather (``after_gather`` once done)
    accumulate_grad     the flat param, with each reduced shard grad
    end_of_forward      the root, when its forward ends (the optimizer may write next)
    end_of_backward     the root, when backward ends
    before_host_write   whatever writes a shard from the host (a load, a summon writeback)
    release             the offloaded optimizer's step (``offload_optimizer_state``)
"""

from __future__ import annotations

import torch
from torch import nn


class DeviceHome:
    """No offload: the shard and its grad live on the compute device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def place(self, shard: nn.Parameter) -> None:
        pass

    def shard_for_gather(self, shard: nn.Parameter) -> torch.Tensor:
        return shard.detach()

    def after_gather(self, shard: nn.Parameter) -> None:
        pass

    def accumulate_grad(self, shard: nn.Parameter, grad: torch.Tensor) -> None:
        """Add a reduced shard grad (compute device, reduce dtype) to the fp32 shard grad."""
        if shard.grad is None:
            shard.grad = grad.to(shard.dtype)
        else:
            shard.grad.add_(grad)

    def end_of_forward(self) -> None:
        """The root's forward has ended; the optimizer may write the shards next."""

    def end_of_backward(self) -> None:
        pass

    def before_host_write(self, shard: nn.Parameter) -> None:
        """The host is about to write ``shard`` (a load, a summon writeback): no copy of it
        may still be reading it."""

    def release(self) -> None:
        """After the optimizer step: nothing needs to stay resident."""
