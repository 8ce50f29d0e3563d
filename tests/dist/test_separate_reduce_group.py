"""``FSDPModule.set_separate_reduce_scatter_group``: gradients reduce-scatter on a second
process group over the shard ranks (one per rank set), gathers stay on the shard group;
training equals the single-process reference (fp32, bf16, no_sync, clip) at W=2 and W=3,
and ``False`` goes back to the shared group."""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist
from cases import gpt, gpt_run, token_batch, wrap_blocks

from fsdp_lite.core import collectives
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.reference import compare_training
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests


def _separate(model, **kw):
    wrapped = wrap_blocks(model, **kw)
    wrapped.set_separate_reduce_scatter_group()
    return wrapped


def _runs(world: int) -> list:
    return [
        gpt_run("separate RS group", world, wrap=_separate),
        gpt_run("separate RS group", world, "bf16", wrap=_separate),
        gpt_run("separate RS group no_sync", world, wrap=_separate, accumulate=2),
        gpt_run("separate RS group clip", world, wrap=_separate, clip=0.05),
    ]


def _groups_used(world: int, rank: int) -> None:
    seen: dict[str, list] = {"all_gather": [], "reduce_scatter": []}
    originals = (collectives.all_gather_flat, collectives.reduce_scatter_flat)

    def spy(kind, original, output, tensor, group, **kw):
        seen[kind].append(group)
        return original(output, tensor, group, **kw)

    collectives.all_gather_flat = functools.partial(spy, "all_gather", originals[0])
    collectives.reduce_scatter_flat = functools.partial(spy, "reduce_scatter", originals[1])
    try:
        model = wrap_blocks(gpt())
        model.set_separate_reduce_scatter_group()
        x, y = (t.chunk(world)[rank] for t in token_batch(world, 0))
        model(x, y)[1].backward()
        shard = units_of(model)[0].flat_params[0].group
        rs = {id(g) for g in seen["reduce_scatter"]}
        assert len(rs) == 1 and id(shard) not in rs, "one separate group for every unit"
        assert all(g is shard for g in seen["all_gather"])
        (twin,) = {g for g in seen["reduce_scatter"]}
        assert dist.get_process_group_ranks(twin) == dist.get_process_group_ranks(shard)
        model.set_separate_reduce_scatter_group(False)
        seen["reduce_scatter"].clear()
        model(x, y)[1].backward()
        assert all(g is shard for g in seen["reduce_scatter"])
    finally:
        collectives.all_gather_flat, collectives.reduce_scatter_flat = originals


def _cases(rank: int, world: int) -> dict:
    cases = [(run.name, functools.partial(compare_training, run)) for run in _runs(world)]
    cases.append(("gathers on the shard group, reduce-scatters on its twin", functools.partial(
        _groups_used, world, rank)))  # fmt: skip
    return run_subtests(cases)


@pytest.mark.parametrize("world", [2, 3])
def test_separate_reduce_scatter_group_matches_reference(world: int) -> None:
    assert_subtests_passed(run_distributed(_cases, world, timeout=300.0))


def _lifetime(world: int) -> list:
    whole = functools.partial(_separate, optimizer_params="whole")
    return [
        gpt_run("separate RS group", world, wrap=_separate),
        gpt_run("separate RS group, whole params", world, wrap=whole),
    ]


def _three_group_lifetimes(rank: int, world: int, scratch: str) -> dict:
    """A notebook's or a sweep's process: new process groups after the first was
    destroyed, over the same ranks and then at another world size, each reusing the
    first's name. Nothing fsdp_lite kept for an earlier group (its separate reduce-scatter
    group, backend, ownership plans) may reach a later one."""
    results: dict = {}
    name = dist.group.WORLD.group_name
    for lifetime, size in (("first", world), ("second", world), ("third", 1)):
        if lifetime != "first":
            dist.destroy_process_group()
            store = f"file://{scratch}/{lifetime}" + (str(rank) if size == 1 else "")
            dist.init_process_group(
                "gloo", init_method=store, rank=rank if size > 1 else 0, world_size=size
            )
            assert dist.group.WORLD.group_name == name  # what fooled caches keyed by name
        cases = [(f"{lifetime} group: {r.name}", functools.partial(compare_training, r))
                 for r in _lifetime(size)]  # fmt: skip
        results.update(run_subtests(cases))
    return results


def test_process_groups_after_the_first_was_destroyed(tmp_path) -> None:
    assert_subtests_passed(run_distributed(_three_group_lifetimes, 2, str(tmp_path)))
