"""Hybrid sharding, W=4 as 2 shard groups of 2: training equals the reference; gathers
never leave the shard group; one all-reduce per trainable flat param crosses replicas.
The same through FSDP2's ``mesh=`` (2-D and 1-D), and what ``mesh=`` refuses."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from cases import gpt, gpt_run, token_batch, wrap_blocks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_lite
from fsdp_lite.core import collectives, reduce
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import compare_training
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests


def _equivalence_runs(world: int, groups, tmp: str) -> list:
    mp = fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16)
    hybrid = functools.partial(wrap_blocks, process_group=groups)
    synced = functools.partial(hybrid, sync_module_states=True)
    # One directory for all ranks, as on a shared filesystem: each rank's files apart.
    ssd = functools.partial(hybrid, offload=fsdp_lite.SSDOffload(tmp))
    return [
        gpt_run("hybrid SSD offload, one directory", world, wrap=ssd),
        gpt_run("hybrid", world, wrap=hybrid),
        gpt_run("hybrid no_sync", world, wrap=hybrid, accumulate=2),
        gpt_run("hybrid clip", world, wrap=hybrid, clip=0.05),
        gpt_run("hybrid", world, "bf16", wrap=functools.partial(hybrid, mixed_precision=mp)),
        gpt_run("hybrid sync_module_states", world, wrap=synced),
    ]


def _observed_collectives(rank: int, world: int, groups) -> None:
    """Gathers stay in the shard group; each reduce-scatter is issued while the replicate
    all-reduce of the one before is still in flight (overlapping this unit's backward),
    and the root holds no more than those two results."""
    shard_group, _ = groups
    mates = set(dist.get_process_group_ranks(shard_group))
    gathers: list[set[int]] = []
    queued: list[tuple[int, bool]] = []  # at each reduce-scatter: (results held, overlap)
    original, reduce_scatter = collectives.all_gather_flat, reduce.reduce_scatter

    def spy(output, shard, group, **kw):
        gathers.append(set(dist.get_process_group_ranks(group)))
        return original(output, shard, group, **kw)

    def spy_reduce(flat, *args):
        pending = units_of(model)[0].root.in_flight.pending
        overlap = not pending or not pending[-1].replicated.waited
        queued.append((len(pending), overlap))
        return reduce_scatter(flat, *args)

    collectives.all_gather_flat, reduce.reduce_scatter = spy, spy_reduce
    try:
        model = wrap_blocks(gpt(), process_group=groups)
        trainable = sum(f.requires_grad for u in units_of(model) for f in u.flat_params)
        x, y = (t.chunk(world)[rank] for t in token_batch(world, 0))
        for _ in range(2):
            fsdp_lite.reset_stats(model)
            model(x, y)[1].backward()
            stats = fsdp_lite.stats(model)["collectives"]
            assert stats["replicate_all_reduce"]["calls"] == trainable, stats
            assert stats["reduce_scatter"]["calls"] == trainable, stats
    finally:
        collectives.all_gather_flat, reduce.reduce_scatter = original, reduce_scatter
    assert gathers and all(g == mates for g in gathers), (mates, gathers)
    assert queued and all(held <= 2 and overlap for held, overlap in queued), queued


def _mesh_runs(world: int) -> list:
    """FSDP2's ``mesh=``: a 2-D (replicate, shard) mesh is hybrid sharding, a 1-D one
    shards over every rank."""
    two_d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    one_d = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    return [
        gpt_run("mesh= 2-D", world, wrap=functools.partial(wrap_blocks, mesh=two_d)),
        gpt_run("mesh= 1-D", world, wrap=functools.partial(wrap_blocks, mesh=one_d)),
    ]


def _mesh_refused() -> None:
    """Both mesh= and process_group=, a 3-D mesh, a DTensor parameter on the dp dim: each
    refused before anything changes."""
    one_d = init_device_mesh("cpu", (4,))
    with pytest.raises(ValueError, match="both mesh= and process_group="):
        fsdp_lite.FSDPModule(gpt(), mesh=one_d, process_group=one_d.get_group())
    three_d = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    with pytest.raises(ValueError, match=r"3-D mesh with dims \('pp', 'dp', 'tp'\).*world\['dp'\]"):
        fsdp_lite.FSDPModule(gpt(), mesh=three_d)
    with pytest.raises(TypeError, match="DeviceMesh"):
        fsdp_lite.FSDPModule(gpt(), mesh=one_d.get_group())
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    world2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # TP on the very dim fsdp_lite would shard over (tensor-parallel tests: test_tensor_parallel)
    parallelize_module(mlp, world2["dp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with pytest.raises(ValueError, match=r"'0.weight' is a DTensor whose mesh dim 'dp' shares"):
        fsdp_lite.FSDPModule(mlp, mesh=world2["dp"])
    assert isinstance(mlp[0].weight, DTensor) and not units_of(mlp)  # nothing changed


def _hybrid(rank: int, world: int, tmp: str) -> dict:
    with pytest.raises(ValueError, match="must divide the world size 4"):
        fsdp_lite.hybrid_groups(3)
    groups = fsdp_lite.hybrid_groups(2)
    cases = [
        (run.name, functools.partial(compare_training, run))
        for run in _equivalence_runs(world, groups, tmp)
    ]
    observed = functools.partial(_observed_collectives, rank, world, groups)
    cases.append(("gathers within the shard group, all-reduces across replicas", observed))
    cases += [(run.name, functools.partial(compare_training, run)) for run in _mesh_runs(world)]
    cases.append(("mesh=: bad meshes and DTensor parameters refused", _mesh_refused))
    return run_subtests(cases)


def test_hybrid_sharding_two_groups_of_two(tmp_path) -> None:
    assert_subtests_passed(run_distributed(_hybrid, 4, str(tmp_path), timeout=600))


GLOBAL_BATCH = 8


def _step(model, opt, world: int, rank: int, step: int) -> float:
    x, y = (t.chunk(world)[rank] for t in token_batch(world, step, GLOBAL_BATCH // world))
    loss = model(x, y)[1]
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / world


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def _train_hybrid_and_save(rank: int, world: int, path: str) -> None:
    torch.manual_seed(1234)
    model = wrap_blocks(gpt(), process_group=fsdp_lite.hybrid_groups(2))
    opt = _adamw(model.parameters())
    for step in range(3):
        _step(model, opt, world, rank, step)
    fsdp_lite.save_checkpoint(path, model, opt)


def _resume_fully_sharded(rank: int, world: int, path: str) -> None:
    torch.manual_seed(1234)
    ref = gpt()
    ref_opt = _adamw(ref.parameters())
    model = wrap_blocks(gpt())
    opt = _adamw(model.parameters())
    fsdp_lite.load_checkpoint(path, model, opt)
    for step in range(6):
        x, y = token_batch(1, step, GLOBAL_BATCH)
        want = ref(x, y)[1]
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step >= 3:
            got = _step(model, opt, world, rank, step)
            assert abs(got - want.item()) <= 1e-5 * want.item(), (step, got, want.item())
    got_sd, want_sd = model.state_dict(), ref.state_dict()
    for k in want_sd:
        torch.testing.assert_close(got_sd[k], want_sd[k], rtol=0, atol=1e-5, msg=k)


def test_checkpoint_saved_hybrid_resumes_fully_sharded_at_w2(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_train_hybrid_and_save, 4, path, timeout=600)
    run_distributed(_resume_fully_sharded, 2, path, timeout=600)
