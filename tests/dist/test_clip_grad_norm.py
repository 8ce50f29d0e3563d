"""``clip_grad_norm_`` where NCCL and gloo differ, and where grads live off the device
(W=2, gloo), each against the unwrapped model's ``torch.nn.utils.clip_grad_norm_`` on the
same global batch:

- a NaN gradient on one rank makes the inf-norm non-finite on every rank (and leaves the
  grads unscaled), on gloo and under NCCL's float max (``fmax``: a NaN is dropped unless
  every rank has one), emulated here; the replica fingerprint check sees the NaN too;
- with CPU offload, the copies between the grads' device and the compute device do not
  grow with the number of flat params (on a GPU each is a host sync).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist

import fsdp_lite
from fsdp_lite.core import collectives
from fsdp_lite.core.tree import units_of
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests
from tests.dist.cases import gpt, gpt_loss, local_part, token_batch, wrap_blocks

INF = float("inf")


@contextlib.contextmanager
def nccl_float_max() -> Iterator[None]:
    """``dist.all_reduce``'s MAX on float tensors as NCCL computes it: ``fmax`` over the
    ranks, so a NaN survives only where every rank has one."""
    real = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op != dist.ReduceOp.MAX or not tensor.is_floating_point():
            return real(tensor, op=op, group=group, async_op=async_op)
        rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, tensor, group=group)
        tensor.copy_(functools.reduce(torch.fmax, rows))
        return dist.barrier(group=group, async_op=async_op)

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = real


def _backward(make_model=gpt, **wrap) -> tuple[fsdp_lite.FSDPModule, torch.nn.Module]:
    """A wrapped model and its unwrapped twin after one backward on the same global batch."""
    torch.manual_seed(0)
    ref = make_model()
    model = wrap_blocks(copy.deepcopy(ref), **wrap)
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = token_batch(world, 0)
    gpt_loss(ref, batch).backward()
    gpt_loss(model, local_part(batch, rank, world)).backward()
    return model, ref


def _max_semantics(semantics: str) -> contextlib.AbstractContextManager:
    return nccl_float_max() if semantics == "nccl" else contextlib.nullcontext()


def _nan_on_one_rank(semantics: str) -> None:
    model, ref = _backward()
    with _max_semantics(semantics):
        norm = model.clip_grad_norm_(INF, norm_type=INF)  # read only: max_norm inf
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), INF, norm_type=INF)
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
    shard_grads = [g for u in units_of(model) for f in u.flat_params for g in f.grads()]
    if dist.get_rank() == 1:
        shard_grads[0].view(-1)[0] = float("nan")
    next(ref.parameters()).grad.view(-1)[0] = float("nan")
    before = [g.clone() for g in shard_grads]
    with _max_semantics(semantics):
        norm = model.clip_grad_norm_(1e-3, norm_type=INF)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type=INF)
    assert not torch.isfinite(want)
    assert not torch.isfinite(norm), f"rank {dist.get_rank()}: inf-norm {norm} with a NaN"
    for g, b in zip(shard_grads, before, strict=True):  # left unscaled: the caller skips
        torch.testing.assert_close(g, b, equal_nan=True, rtol=0, atol=0)


def _fingerprints_see_a_nan(semantics: str) -> None:
    group = dist.group.WORLD
    same, nan_here = torch.ones(5), torch.ones(5)
    if dist.get_rank() == 1:
        nan_here[2] = float("nan")
    with _max_semantics(semantics):
        differ = collectives.differ_across([same, nan_here], [group], torch.device("cpu"))
    assert differ.tolist() == [False, True], differ


def _offload_copies_per_clip() -> None:
    """Tensor.to calls inside clip_grad_norm_ (a cross-device copy each on a GPU with CPU
    offload), for 1 and 4 blocks: equal, and the norm the reference's."""
    counts = []
    for n_layer in (1, 4):
        model, ref = _backward(
            functools.partial(gpt, n_layer=n_layer), offload=fsdp_lite.CPUOffload()
        )
        calls: list = []
        real = torch.Tensor.to

        def counted(self, *args, calls=calls, real=real, **kwargs):
            calls.append(args)
            return real(self, *args, **kwargs)

        torch.Tensor.to = counted
        try:
            norm = model.clip_grad_norm_(0.05)
        finally:
            torch.Tensor.to = real
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        torch.testing.assert_close(norm, want, rtol=1e-5, atol=0)
        counts.append(len(calls))
    assert counts[0] == counts[1], f"Tensor.to calls per clip, 1 vs 4 blocks: {counts}"


def _cases(rank: int, world: int) -> dict:
    cases = []
    for semantics in ("gloo", "nccl"):
        cases += [
            (f"inf-norm with a NaN on one rank ({semantics} max)",
             functools.partial(_nan_on_one_rank, semantics)),
            (f"replica fingerprints see a NaN on one rank ({semantics} max)",
             functools.partial(_fingerprints_see_a_nan, semantics)),
        ]  # fmt: skip
    cases.append(
        ("CPU offload: copies per clip independent of flat params", _offload_copies_per_clip)
    )
    return run_subtests(cases)


def test_clip_grad_norm_across_backends_and_offload() -> None:
    assert_subtests_passed(run_distributed(_cases, 2, timeout=300))
