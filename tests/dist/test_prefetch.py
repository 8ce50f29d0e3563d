"""Prefetching: results equal the reference whatever the policy; the collectives issued
are exactly the designed sequence; the in-flight limit bounds the full buffers alive."""

from __future__ import annotations

import functools

import pytest
import torch
from cases import PRECISIONS, gpt, gpt_run, token_batch, wrap_blocks
from torch import nn

import fsdp_lite
from fsdp_lite import PrefetchPolicy
from fsdp_lite.core import collectives
from fsdp_lite.core import reduce as reduce_module
from fsdp_lite.core.tree import unit_of
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.models import Block, GPTConfig
from fsdp_lite.testing.reference import compare_training

POLICIES = {
    "off": None,
    "limit 1": PrefetchPolicy(max_in_flight=1),
    "limit 2": PrefetchPolicy(max_in_flight=2),
    "forward only": PrefetchPolicy(backward=False),
    "backward only": PrefetchPolicy(forward=False),
}


def _equivalence(world: int) -> None:
    for name, policy in POLICIES.items():
        for raf in (None, True, False):
            wrap = functools.partial(wrap_blocks, prefetch=policy, reshard_after_forward=raf)
            compare_training(gpt_run(f"prefetch {name}", world, raf=raf, wrap=wrap))
    wrap = functools.partial(
        wrap_blocks, prefetch=PrefetchPolicy(max_in_flight=1), mixed_precision=PRECISIONS["bf16"][0]
    )
    compare_training(gpt_run("prefetch limit 1", world, "bf16", wrap=wrap))


def _log_collectives(log: list) -> None:
    gather, reduce = collectives.all_gather_flat, collectives.reduce_scatter_flat

    def logged_gather(output, shard, group, **kw):
        log.append(("AG", kw["tag"].name))
        return gather(output, shard, group, **kw)

    def logged_reduce(output, full, group, **kw):
        log.append(("RS", kw["tag"].name))
        return reduce(output, full, group, **kw)

    collectives.all_gather_flat, collectives.reduce_scatter_flat = logged_gather, logged_reduce


def _sequence(policy: PrefetchPolicy | None, raf: bool | None = None) -> list[list]:
    """Collectives of two training iterations of root + 2 blocks (root keeps its params)."""
    model = wrap_blocks(gpt(), prefetch=policy, reshard_after_forward=raf)
    log: list = []
    _log_collectives(log)
    x, y = token_batch(1, 0)
    per_iteration = []
    for _ in range(2):
        log.clear()
        model(x, y)[1].backward()
        per_iteration.append([f"{op} {unit}" for op, unit in log])
    return per_iteration


R, B0, B1 = "<root GPT>", "blocks.0", "blocks.1"
# Iteration 1 records the orders: every block is resharded after forward and gathered
# again in backward.
FIRST = [
    f"AG {R}",
    f"AG {B0}",
    f"AG {B1}",
    f"AG {B1}",
    f"RS {B1}",
    f"AG {B0}",
    f"RS {B0}",
    f"RS {R}",
]
EXPECTED = {
    "off": [FIRST, FIRST],
    "limit 1": [FIRST, FIRST],  # only the running unit's own gather is in flight
    # From iteration 2, blocks.1's forward prefetches nothing (last); its backward
    # gathers it again (the root's backward prefetches nothing: the step's highest point)
    # and prefetches blocks.0 before its own reduce-scatter.
    "limit 2": [
        FIRST,
        [
            f"AG {R}",
            f"AG {B0}",
            f"AG {B1}",
            f"AG {B1}",
            f"AG {B0}",
            f"RS {B1}",
            f"RS {B0}",
            f"RS {R}",
        ],
    ],
}


def _check_sequences() -> None:
    for name, expected in EXPECTED.items():
        got = _sequence(POLICIES[name])
        assert got == expected, f"{name}:\n got      {got}\n expected {expected}"
    # Asked for explicitly, every unit (the root too) is resharded after forward and
    # gathered again in backward, every iteration.
    got = _sequence(None, raf=True)
    assert got[0] == got[1] and all(got[1].count(f"AG {u}") == 2 for u in (R, B0, B1)), got


def _check_order_recorded_again_after_a_different_first_pass() -> None:
    """A first iteration in another order (a warm-up) does not turn prefetching off for
    the run: the next pass strays, sets the order (counted in stats()), and from the third
    iteration on the collectives are those of a run whose first pass was in order."""
    model = wrap_blocks(gpt(), prefetch=POLICIES["limit 2"])
    blocks = model.module.blocks
    log: list = []
    _log_collectives(log)
    x, y = token_batch(1, 0)
    blocks[0], blocks[1] = blocks[1], blocks[0]  # the warm-up's order
    model(x, y)[1].backward()
    blocks[0], blocks[1] = blocks[1], blocks[0]
    changes = []
    for _ in range(3):
        log.clear()
        fsdp_lite.reset_stats(model)
        model(x, y)[1].backward()
        changes.append(fsdp_lite.stats(model)["order_changes"])
    assert changes == [{"forward": 1, "backward": 1}, {}, {}], changes
    got = [f"{op} {unit}" for op, unit in log]
    swapped = {B0: B1, B1: B0}  # units are named where they were at the first forward
    want = [
        f"{op} {swapped.get(unit, unit)}"
        for op, unit in (line.split(" ", 1) for line in EXPECTED["limit 2"][1])
    ]
    assert got == want, got


def _check_reduce_scatter_inputs_bounded() -> None:
    """A backward keeps at most one reduce-scatter (holding memory the size of a full
    gradient) in flight, not every unit's until its end; and, before each is issued, holds
    at most the one result before it that has not reached its shard grad."""
    reduce_scatter, in_flight, held = reduce_module.reduce_scatter, [], []
    model = wrap_blocks(gpt(n_layer=6))

    def spy(flat, *args):  # called once the previous reduce-scatter was waited for
        pending = unit_of(model).root.in_flight.pending
        in_flight.append(sum(not p.waited for p in pending) + 1)  # + the next
        held.append(len(pending))
        return reduce_scatter(flat, *args)

    reduce_module.reduce_scatter = spy
    try:
        x, y = token_batch(1, 0)
        for _ in range(2):
            model(x, y)[1].backward()
    finally:
        reduce_module.reduce_scatter = reduce_scatter
    assert len(in_flight) == 2 * 7, in_flight  # before each unit's reduce-scatter
    assert max(in_flight) <= 1, in_flight
    assert max(held) <= 1, held


class Blocks(nn.Module):
    """Four blocks and nothing else: the root owns no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(GPTConfig()) for _ in range(4)))

    def forward(self, x):
        return self.blocks(x)


def _check_in_flight_bound() -> None:
    for limit in (1, 2, 3):
        for make, enclosing in ((Blocks, 0), (functools.partial(gpt, n_layer=4), 1)):
            model = wrap_blocks(make(), prefetch=PrefetchPolicy(max_in_flight=limit))
            x = torch.randn(2, 16, 32) if make is Blocks else token_batch(1, 0)[0]
            for _ in range(3):
                fsdp_lite.reset_stats(model)
                out = model(x)
                (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
                peak = fsdp_lite.stats(model)["unsharded_units_peak"]
                assert peak <= limit + enclosing, (make, limit, peak)
            assert peak == min(limit, 4) + enclosing, (make, limit, peak)  # prefetch happened


def _prefetch(rank: int, world: int) -> None:
    _equivalence(world)
    _check_sequences()
    _check_order_recorded_again_after_a_different_first_pass()
    _check_in_flight_bound()
    _check_reduce_scatter_inputs_bounded()


@pytest.mark.parametrize("world", [2])
def test_prefetch(world: int) -> None:
    run_distributed(_prefetch, world)
