"""The frozen schedule: one function builds it from the recorded orders, for the step and
for the planner's replay alike; the root rebuilds it only when an order changes."""

from __future__ import annotations

import torch

import fsdp_lite
from fsdp_lite.core import accounting, schedule
from fsdp_lite.core.policies import PrefetchPolicy
from fsdp_lite.testing import GPT, GPTConfig
from fsdp_lite.testing.models import Block


def test_default_schedule_keeps_only_the_root_and_its_backward_prefetches_nothing() -> None:
    units = ["root", "a", "b", "c"]
    sched = schedule.build(
        units, "root", lambda u: None, units, ["root", "c", "b", "a"], PrefetchPolicy()
    )
    assert sched.keeps_full == frozenset({"root"})
    assert sched.forward_prefetch == (("a",), ("b",), ("c",), ())
    assert sched.backward_prefetch == ((), ("b",), ("a",), ())
    assert sched.prefetches(None, backward=False) == ()  # a pass off its recorded order


def test_reshard_after_forward_and_max_in_flight() -> None:
    units = [0, 1, 2, 3]
    keep_all = schedule.build(units, 0, lambda u: False, units, units[::-1], None)
    assert keep_all.keeps_full == frozenset(units)
    assert keep_all.forward_prefetch == ((), (), (), ())  # prefetch=None: none
    free_all = schedule.build(
        units, 0, lambda u: True, units, [0, 3, 2, 1], PrefetchPolicy(max_in_flight=3)
    )
    assert free_all.keeps_full == frozenset()
    assert free_all.forward_prefetch == ((1, 2), (2, 3), (3,), ())
    assert free_all.backward_prefetch == ((), (2, 1), (1,), ())
    no_backward = PrefetchPolicy(backward=False)
    only_forward = schedule.build(units, 0, lambda u: None, units, units[::-1], no_backward)
    assert only_forward.backward_prefetch == ((), (), (), ())
    assert only_forward.forward_prefetch[0] == (1,)


def test_an_order_is_replaced_only_when_a_pass_strays() -> None:
    ledger = accounting.Ledger()
    order: schedule.ExecOrder[str] = schedule.ExecOrder("forward", ledger)
    order.start()
    assert [order.visit(u) for u in "abc"] == [None, None, None]  # nothing recorded yet
    assert order.freeze() is True  # the first pass sets the order
    order.start()
    assert [order.visit(u) for u in "abc"] == [0, 1, 2]
    assert order.freeze() is False  # on track: the schedule stands
    order.start()
    assert [order.visit(u) for u in "ab"] == [0, 1]
    assert order.freeze() is False  # a prefix (an early exit) keeps it
    order.start()
    assert [order.visit(u) for u in "acb"] == [0, None, None]
    assert order.freeze() is True  # strayed: its own order replaces the recorded one
    assert order.recorded == ["a", "c", "b"]
    assert dict(ledger.order_changes) == {"forward": 1}  # the first pass is no change


def test_the_root_builds_its_schedule_once_per_order(world1, monkeypatch) -> None:
    """Steady steps reuse the frozen schedule: it is built when the root is made and when
    each direction's first pass sets its order, then never again while the orders hold;
    a forward that strays (a block skipped) rebuilds it."""
    built = []
    build = schedule.build
    monkeypatch.setattr(schedule, "build", lambda *a, **k: built.append(1) or build(*a, **k))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16)
    model = fsdp_lite.FSDPModule(GPT(cfg), auto_wrap_policy=fsdp_lite.wrap.by_type(Block))
    x = torch.randint(0, 64, (2, 8))
    for _ in range(4):
        model(x, x)[1].backward()
    assert len(built) == 3, built  # at the root's making, then forward's and backward's order
    inner = model.module
    blocks = list(inner.blocks)
    inner.blocks = torch.nn.ModuleList([blocks[0], blocks[2], blocks[1]])
    model(x, x)[1].backward()
    assert len(built) == 5, built  # both orders changed: rebuilt once each
    model(x, x)[1].backward()
    assert len(built) == 5, built
