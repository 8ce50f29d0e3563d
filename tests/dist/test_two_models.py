"""Two independent wrapped models in one process (W=2, gloo), each against the same two
models unwrapped on one process over the global batch, losses step by step and parameters
at the end:

- distillation: a frozen teacher's logits (``no_grad``) in a student's loss, both wrapped,
  on the same process group; ``fsdp_lite.stats`` counts each model's collectives apart
  (the teacher's gathers, the student's gathers and reduce-scatters), and of both together;
- RL fine-tuning: a policy and a reference model both trained, in alternation, the
  reference on a process group of its own and with whole-parameter shards; wrapping it
  leaves the policy's shard layout as it was.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fsdp_lite
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests
from tests.dist.cases import (
    assert_close_loss,
    gpt,
    gpt_loss,
    local_part,
    mean_over_ranks,
    token_batch,
    wrap_blocks,
)

STEPS = 3


def _same_params(model, ref, what: str) -> None:
    got = model.state_dict()
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-5, msg=f"{what} {name}")


def _distill_loss(student, teacher, batch) -> torch.Tensor:
    x, y = batch
    with torch.no_grad():
        target = F.softmax(teacher(x)[0], dim=-1)
    logits = student(x)[0]
    kl = F.kl_div(F.log_softmax(logits, dim=-1), target, reduction="batchmean")
    return gpt_loss(student, batch) + kl


def _distillation() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref_teacher, ref_student = gpt(n_layer=3), gpt()
    teacher = wrap_blocks(copy.deepcopy(ref_teacher))
    student = wrap_blocks(copy.deepcopy(ref_student))
    for m in (ref_teacher, teacher):
        m.requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref_student.parameters(), lr=1e-3)
    for step in range(STEPS):
        batch = token_batch(world, step)
        for m in (teacher, student):
            fsdp_lite.reset_stats(m)
        want = _distill_loss(ref_student, ref_teacher, batch)
        got = _distill_loss(student, teacher, local_part(batch, rank, world))
        want.backward(), got.backward()
        assert_close_loss(f"step {step} loss", mean_over_ranks(got), want.item(), 1e-5)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        if step > 0:  # the first step also runs the divergence check in lockstep
            _counted_apart(teacher, student)
    _same_params(student, ref_student, "student")
    _same_params(teacher, ref_teacher, "teacher")


def _counted_apart(teacher: nn.Module, student: nn.Module) -> None:
    """One distillation step as each model's stats count it: the teacher gathered each of
    its flat params once (no_grad forward) and reduced nothing; the student gathered and
    reduce-scattered each of its own; both together add up."""

    def flats(model):
        return [f for u in units_of(model) for f in u.flat_params]

    def calls(stats, op):
        return stats["collectives"].get(op, {}).get("calls", 0)

    t, s = fsdp_lite.stats(teacher), fsdp_lite.stats(student)
    both = fsdp_lite.stats(nn.ModuleList([teacher, student]))
    t_flats, s_flats = flats(teacher), flats(student)
    assert calls(t, "all_gather") == len(t_flats), t["collectives"]
    assert calls(t, "reduce_scatter") == 0, t["collectives"]
    assert t["collectives"]["all_gather"]["bytes"] == sum(f.padded_numel * 4 for f in t_flats)
    assert calls(s, "reduce_scatter") == len(s_flats), s["collectives"]
    assert calls(s, "all_gather") >= len(s_flats), s["collectives"]
    for op in ("all_gather", "reduce_scatter"):
        assert calls(both, op) == calls(t, op) + calls(s, op), (op, both["collectives"])
    assert t["full_bytes_now"] == s["full_bytes_now"] == 0, (t, s)
    assert t["full_bytes_peak"] > 0 and s["full_bytes_peak"] > 0, (t, s)


def _policy_and_reference() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    refs = [gpt(), gpt(n_layer=3)]
    policy = wrap_blocks(copy.deepcopy(refs[0]), optimizer_params="whole")
    bounds = [f.bounds for u in units_of(policy) for f in u.flat_params]
    other_group = dist.new_group(list(range(world)))
    reference = wrap_blocks(
        copy.deepcopy(refs[1]), optimizer_params="whole", process_group=other_group
    )
    assert [f.bounds for u in units_of(policy) for f in u.flat_params] == bounds
    models = [policy, reference]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    ref_opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in refs]
    for step in range(STEPS):
        batch = token_batch(world, step)
        for i, (model, opt, ref, ref_opt) in enumerate(
            zip(models, opts, refs, ref_opts, strict=True)
        ):
            want = gpt_loss(ref, batch)
            got = gpt_loss(model, local_part(batch, rank, world))
            want.backward(), got.backward()
            assert_close_loss(
                f"step {step} model {i} loss", mean_over_ranks(got), want.item(), 1e-5
            )
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
    _same_params(policy, refs[0], "policy")
    _same_params(reference, refs[1], "reference")


def _cases(rank: int, world: int) -> dict:
    return run_subtests(
        [
            ("distillation: a frozen teacher and a student, one group", _distillation),
            ("a policy and a reference model, two groups, whole params", _policy_and_reference),
        ]
    )


def test_two_wrapped_models_train_equal_to_their_references() -> None:
    assert_subtests_passed(run_distributed(_cases, 2, timeout=180))
