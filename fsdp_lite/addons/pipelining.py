"""Pipeline parallelism with torch's ``torch.distributed.pipelining``, over stage modules
wrapped with fsdp_lite on the data-parallel dim of a (pp, dp) mesh.

torch's schedules drive data parallelism through the stage: for an FSDP2 module they turn
gradient sync and resharding off for every micro-batch's backward but the stage's last,
and reduce at the end. They know only FSDP2's and DDP's classes; :class:`PipelineStage`,
torch's ``PipelineStage`` with that one step taught to fsdp_lite, does the same through
FSDP2's methods, which fsdp_lite has (``set_requires_gradient_sync``,
``set_reshard_after_backward``), from the step's first forward (FSDP2's from its first
backward). Each unit is then gathered once per step and reduce-scattered once, in the
stage's last backward, whatever the number of micro-batches, and holds its full
parameters from its first forward to that backward; the schedule's ``scale_grads`` then
divides the reduced shard grads. Build it where you would build torch's, and run any schedule that
calls a full backward per micro-batch (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``).

Zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``, or any schedule with separate input- and weight-backward actions)
are refused: their weight backward asks autograd for the gradients of
``submod.parameters()``, which an fsdp_lite unit does not compute through (its forward
runs on views of the gathered full parameters). :func:`check_schedule` refuses them
before anything runs; a stage run by one anyway raises at its first split backward,
before it computes a gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    PipelineScheduleMulti,
    PipelineScheduleSingle,
)

from fsdp_lite.core.tree import unit_of

# The actions of a schedule that splits backward in two (zero bubble).
_SPLIT_BACKWARD = (BACKWARD_INPUT, BACKWARD_WEIGHT)


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` (same arguments) over an fsdp_lite ``FSDPModule``: every
    micro-batch's backward accumulates unsharded gradients into kept full parameters but
    the last, which reduce-scatters the sum and reshards (FSDP2's treatment in torch's
    schedules)."""

    def __init__(self, submodule: nn.Module, *args: Any, **kwargs: Any) -> None:
        if unit_of(submodule) is None:
            raise TypeError(
                "fsdp_lite.addons.pipelining.PipelineStage takes a stage module wrapped with "
                f"fsdp_lite.FSDPModule, got {type(submodule).__name__}: wrap the stage "
                "(FSDPModule(stage, mesh=world['dp'], ...)) or use torch's PipelineStage"
            )
        super().__init__(submodule, *args, **kwargs)

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        if self.has_backward and torch.is_grad_enabled():
            self._sync_and_reshard(False)  # from the step's first forward: gather once
        return super().forward_maybe_with_nosync(*args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        if backward_type != "full":
            raise NotImplementedError(
                f"fsdp_lite: stage {self.stage_index} was asked for a split backward "
                f"({backward_type!r}), which zero-bubble schedules (ScheduleInterleavedZero"
                "Bubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) use: fsdp_lite units do "
                "not support it. Use ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B "
                "(fsdp_lite.addons.pipelining.check_schedule refuses such a schedule before it "
                "runs). No gradient was computed; call model.reset_training_state() to "
                "train on."
            )
        self._sync_and_reshard(last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def _sync_and_reshard(self, last: bool) -> None:
        """Micro-batches before the last: gradients accumulate unsharded on kept full
        parameters. The last backward reduce-scatters their sum and reshards."""
        self.submod.set_requires_gradient_sync(last)
        self.submod.set_reshard_after_backward(last)


def check_schedule(schedule: PipelineScheduleSingle | PipelineScheduleMulti) -> None:
    """Refuse, before anything runs, a schedule fsdp_lite stages cannot run: one that
    splits backward into input and weight parts (zero bubble), or whose stages are not
    :class:`PipelineStage`."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    for stage in stages:
        if stage is not None and unit_of(stage.submod) is not None:
            if not isinstance(stage, PipelineStage):
                raise TypeError(
                    f"fsdp_lite: stage {stage.stage_index} of {type(schedule).__name__} holds "
                    "an fsdp_lite module in torch's PipelineStage, which would reduce-scatter "
                    "every micro-batch's gradient: build it with "
                    "fsdp_lite.addons.pipelining.PipelineStage"
                )
    order = getattr(schedule, "pipeline_order", None) or {}
    for actions in order.values():
        for action in actions:
            if action is not None and action.computation_type in _SPLIT_BACKWARD:
                raise NotImplementedError(
                    f"fsdp_lite: {type(schedule).__name__} splits backward into input and "
                    "weight parts (zero bubble), which fsdp_lite units do not support: use "
                    "ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B"
                )
