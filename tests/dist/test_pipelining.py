"""Pipeline parallelism: torch's schedules over stage modules wrapped with fsdp_lite on the
dp dim of a (pp=2, dp=2) mesh (W=4, gloo), through ``fsdp_lite.pipelining.PipelineStage``.

Each schedule trains against a single-process reference of the whole model on the same
global batch (losses every step, parameters at the end) and issues, per stage and step,
one all-gather and one reduce-scatter per flat param whatever the number of
micro-batches. Zero-bubble schedules are refused before they run.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

import fsdp_lite
from fsdp_lite.addons.pipelining import PipelineStage, check_schedule
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests

VOCAB, DIM, SEQ = 32, 16, 8
N_BLOCKS = 6
MICRO = 4
PER_DP_RANK = 8  # samples per dp rank and step: 2 per micro-batch
STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    head = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB))
    return nn.Sequential(nn.Embedding(VOCAB, DIM), *[Block() for _ in range(N_BLOCKS)], head)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randint(0, VOCAB, (PER_DP_RANK * dp, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _stage_layers(n_stages: int) -> list[list[int]]:
    """Which of the model's layers each stage holds: embedding with the first, head with
    the last, blocks spread evenly."""
    n_layers = N_BLOCKS + 2
    per = n_layers // n_stages
    return [list(range(i * per, n_layers if i == n_stages - 1 else (i + 1) * per))
            for i in range(n_stages)]  # fmt: skip


def _train(schedule_cls, stages_per_rank: int, **wrap_kw) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    pp_rank, pp_size, dp_size = pp.get_local_rank(), pp.size(), dp.size()
    n_stages = pp_size * stages_per_rank
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    layers = _stage_layers(n_stages)
    mine = [pp_rank + k * pp_size for k in range(stages_per_rank)]  # looped placement
    modules, stages = [], []
    for index in mine:
        part = nn.Sequential(*[copy.deepcopy(ref[i]) for i in layers[index]])
        model = fsdp_lite.FSDPModule(
            part, mesh=dp, auto_wrap_policy=fsdp_lite.wrap.by_type(Block), **wrap_kw
        )
        modules.append(model)
        stages.append(
            PipelineStage(model, index, n_stages, torch.device("cpu"), group=pp.get_group())
        )
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in modules]
    stage_arg = stages if stages_per_rank > 1 else stages[0]
    schedule = schedule_cls(stage_arg, n_microbatches=MICRO, loss_fn=_loss)
    check_schedule(schedule)
    flats = [sum(len(u.flat_params) for u in units_of(m)) for m in modules]
    holds_last = (n_stages - 1) in mine
    for step in range(STEPS):
        x, y = _batch(step, dp_size)
        ref_loss = _loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        xs, ys = x.chunk(dp_size)[dp.get_local_rank()], y.chunk(dp_size)[dp.get_local_rank()]
        fsdp_lite.reset_stats(nn.ModuleList(modules))
        losses: list[torch.Tensor] = []
        if pp_rank == 0:
            schedule.step(xs, target=ys, losses=losses)
        else:
            schedule.step(target=ys, losses=losses)
        calls = fsdp_lite.stats(nn.ModuleList(modules))["collectives"]
        gathers, reduces = calls["all_gather"]["calls"], calls["reduce_scatter"]["calls"]
        # The first step also runs torch's metadata inference (a forward and backward)
        if step > 0 and (gathers, reduces) != (sum(flats), sum(flats)):
            raise AssertionError(
                f"step {step}, stages {mine}: {gathers} all-gathers and {reduces} "
                f"reduce-scatters, expected {sum(flats)} of each (flat params {flats})"
            )
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if holds_last:
            got = torch.stack(losses).mean().detach()
            dist.all_reduce(got, group=dp.get_group())
            got = got.item() / dp_size
            if abs(got - ref_loss.item()) > 1e-5 * abs(ref_loss.item()):
                raise AssertionError(f"step {step}: loss {got:.8g} vs reference {ref_loss:.8g}")
    for index, model in zip(mine, modules, strict=True):
        full = model.state_dict()
        want = nn.Sequential(*[ref[i] for i in layers[index]]).state_dict()
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _refused() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    pp_rank = pp.get_local_rank()
    layers = _stage_layers(4)
    ref = _model()

    def stage(index: int, cls=PipelineStage):
        part = nn.Sequential(*[copy.deepcopy(ref[i]) for i in layers[index]])
        model = fsdp_lite.FSDPModule(part, mesh=dp)
        return cls(model, index, 4, torch.device("cpu"), group=pp.get_group())

    stages = [stage(pp_rank), stage(pp_rank + 2)]
    zero_bubble = ScheduleInterleavedZeroBubble(stages, n_microbatches=MICRO, loss_fn=_loss)
    with pytest.raises(NotImplementedError, match="ScheduleInterleavedZeroBubble splits backward"):
        check_schedule(zero_bubble)
    with pytest.raises(NotImplementedError, match="split backward \\('input'\\)"):
        stages[0].backward_maybe_with_nosync("input", {})
    torch_stages = [stage(pp_rank, TorchPipelineStage), stage(pp_rank + 2, TorchPipelineStage)]
    plain = ScheduleInterleaved1F1B(torch_stages, n_microbatches=MICRO, loss_fn=_loss)
    with pytest.raises(TypeError, match="build it with fsdp_lite.addons.pipelining.PipelineStage"):
        check_schedule(plain)
    with pytest.raises(TypeError, match="takes a stage module wrapped with fsdp_lite"):
        PipelineStage(nn.Linear(2, 2), 0, 4, torch.device("cpu"), group=pp.get_group())


def _cases(rank: int, world: int) -> dict:
    return run_subtests([
        ("GPipe", functools.partial(_train, ScheduleGPipe, 1)),
        ("1F1B", functools.partial(_train, Schedule1F1B, 1)),
        ("1F1B, pieces", functools.partial(_train, Schedule1F1B, 1, optimizer_params="pieces")),
        ("interleaved 1F1B, 2 stages per rank",
         functools.partial(_train, ScheduleInterleaved1F1B, 2)),
        ("zero bubble and torch's own stage refused", _refused),
    ])  # fmt: skip


def test_pipeline_schedules_over_fsdp_lite_stages() -> None:
    assert_subtests_passed(run_distributed(_cases, 4, timeout=600))
