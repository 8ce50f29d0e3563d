"""Gradient reduction: the averaging reduce-scatter of a flat param's full gradient
(whole, or in widened pieces), the ``PendingGrad`` that carries its result into the
shard's fp32 grad, and ``InFlight``, the root's queue of them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from fsdp_lite.core import collectives, devices
from fsdp_lite.core.flat_param import FlatParam

# A gradient reduced in a wider dtype than its own (bf16 compute, fp32 reduction) needs a
# wide copy twice its size. Above this many bytes that copy is made and reduce-scattered
# in pieces of at most this size, so a large unit's gradient (a 50k-token embedding) needs
# little more than itself at its reduce-scatter.
WIDEN_PIECE_BYTES = 64 * 2**20


def reduce_pieces(
    numel: int, grad_dtype: torch.dtype, reduce_dtype: torch.dtype, even: bool
) -> int:
    """How many pieces a gradient of ``numel`` elements is reduce-scattered in (1: whole):
    widened in pieces of at most WIDEN_PIECE_BYTES, by columns of the (W, shard) layout,
    which only an ``even`` layout has (whole params' per-rank sizes differ). The step and
    the memory planner's replay both ask this."""
    if reduce_dtype.itemsize <= grad_dtype.itemsize or not even:
        return 1
    return -(-numel * reduce_dtype.itemsize // WIDEN_PIECE_BYTES)


def predivide_factor(ranks: int, reduce_dtype: torch.dtype) -> int:
    """What a gradient averaged over ``ranks`` is divided by before the sum (the rest,
    ``ranks / factor``, after). fp32: 1. Low precision: about sqrt(ranks) (a power of 2,
    as PyTorch FSDP), so the sum of ``ranks`` gradients overflows no sooner than one
    gradient times sqrt(ranks), and a small gradient divided by ``ranks`` before the sum
    does not underflow."""
    if reduce_dtype.itemsize >= 4:
        return 1
    factor = 1
    while ranks % factor == 0 and ranks / factor > factor:
        factor *= 2
    return factor


def reduce_scatter(
    flat: FlatParam, reduce_dtype: torch.dtype, stream: torch.cuda.Stream | None = None
) -> PendingGrad | None:
    """Start the averaging reduce-scatter of the gradient ``flat`` holds (its full gradient
    plus any no_sync accumulation). A gradient widened in pieces is widened and reduced on
    ``stream`` (the root's reduce stream; None: the current one)."""
    grad = flat.take_grad()
    if grad is None:
        return None
    ranks = flat.averaged_over
    with torch.no_grad():
        pieces = reduce_pieces(grad.numel(), grad.dtype, reduce_dtype, even=flat.rank_sizes is None)
        if pieces > 1:  # by columns of the (W, shard) layout
            out = torch.empty(flat.shard_numel, dtype=reduce_dtype, device=grad.device)
            works = _reduce_widened(flat, grad, out, pieces, stream)
            return PendingGrad(flat, works, out, ranks, queued=devices.mark(stream))
        grad = grad.to(reduce_dtype)  # the compute-dtype gradient is dropped here
        # In fp32, divide only the 1/W-sized result (one full-size pass saved); in low
        # precision, part before the sum and part after (see predivide_factor).
        pre = predivide_factor(ranks, reduce_dtype)
        if pre != 1:
            grad.div_(pre)
        out = torch.empty(flat.shard_numel, dtype=reduce_dtype, device=grad.device)
        work = collectives.reduce_scatter_flat(
            out, grad, flat.reduce_group, tag=flat.tag, sizes=flat.rank_sizes
        )
    return PendingGrad(flat, [work], out, ranks / pre)


def _reduce_widened(
    flat: FlatParam,
    grad: torch.Tensor,
    out: torch.Tensor,
    pieces: int,
    stream: torch.cuda.Stream | None,
) -> list[collectives.Handle]:
    """Reduce-scatter a low-precision ``grad`` in a wider dtype, a slice of columns of
    its (W, shard) layout at a time, so the wide copy never exists whole (see
    WIDEN_PIECE_BYTES); at most two pieces in flight.

    On CUDA the widening and the waits between pieces run on ``stream``, after the
    gradient: waited for on the compute stream, a piece's reduce-scatter -- queued on the
    communicator behind the next unit's prefetched all-gather -- would hold up the next
    unit's backward."""
    columns = grad.view(flat.world_size, flat.shard_numel)
    step = -(-flat.shard_numel // pieces)
    works: list[collectives.Handle] = []
    with devices.on_stream(stream, grad, out):
        for lo in range(0, flat.shard_numel, step):
            hi = min(lo + step, flat.shard_numel)
            if len(works) >= 2:
                works[-2].wait(exposed=stream is None)
            wide = torch.empty((flat.world_size, hi - lo), dtype=out.dtype, device=grad.device)
            wide.copy_(columns[:, lo:hi])
            works.append(
                collectives.reduce_scatter_flat(
                    out[lo:hi], wide.view(-1), flat.reduce_group, tag=flat.tag
                )
            )
    return works


class InFlight:
    """A root's reduce-scatters in flight, in issue order (the same on every rank, whatever
    the timing): each gradient reaches its shard grad a step or two behind its issue.

    Before a reduce-scatter is issued the one before it is waited for, so at most one is
    in flight. Until waited for, each holds memory the size of its full gradient (gloo's
    copy; NCCL's stashed input); the previous one had a unit's whole backward to finish.
    With hybrid sharding that wait starts its replicate all-reduce, which then has the
    next unit's backward to overlap. Once issued, every earlier result whose replicate
    all-reduce (if any) had that time is added to its shard grad (``PendingGrad.finish``)
    and its output freed, so a backward holds at most two reduced outputs, not one per
    flat param."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self.pending: list[PendingGrad] = []
        self.stream = stream  # where widened gradients are reduced (see _reduce_widened)

    def issue(self, flat: FlatParam, reduce_dtype: torch.dtype) -> None:
        """Reduce-scatter the gradient ``flat`` holds; finish what is settled."""
        if self.pending:
            self.pending[-1].wait_and_replicate()  # every earlier one was, the same way
        pending = reduce_scatter(flat, reduce_dtype, self.stream)
        if pending is None:
            return
        self.pending.append(pending)
        replicating = len(self.pending) > 1 and self.pending[-2].replicated is not None
        self._finish(keep=2 if replicating else 1)

    def drain(self) -> None:
        """End of backward: every result into its shard grad, in issue order."""
        self._finish(keep=0)

    def _finish(self, keep: int) -> None:
        while len(self.pending) > keep:
            self.pending.pop(0).finish()

    def abandon(self) -> None:
        """An interrupted backward: wait for what is in flight, add none of it."""
        for pending in self.pending:
            with contextlib.suppress(Exception):
                pending.wait()
        self.pending.clear()


@dataclass
class PendingGrad:
    """A reduce-scatter in flight (one or more collectives); ``finish`` adds its result to
    the shard's fp32 grad. With hybrid sharding, ``wait_and_replicate`` starts the
    all-reduce of the result across replicas as soon as the reduce-scatter is waited for.

    The full-size input is not referenced here: the process group keeps what the
    collective needs alive until it completes (gloo reduces a copy of its own, NCCL
    stashes the input or records its stream), and waiting releases the work and, with
    it, that memory.
    """

    flat: FlatParam
    works: list[collectives.Handle]
    out: torch.Tensor  # (shard_numel,) in reduce dtype
    divide_by: float  # what the result is still to be divided by (1: the input was)
    # The end of what was queued on the reduce stream (the widening, and at W=1 the copy
    # into ``out``): the current stream waits for it with the collectives.
    queued: torch.cuda.Event | None = None
    replicated: collectives.Handle | None = None  # the replicate all-reduce in flight
    replicating: bool = False

    @property
    def waited(self) -> bool:
        """Has the reduce-scatter been waited for (its full-size input released)?"""
        return all(work.waited for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        devices.wait_mark(self.queued)
        self.queued = None

    def wait_and_replicate(self) -> None:
        """Wait for the reduce-scatter, then (hybrid sharding) start the replicate
        all-reduce of its result. On NCCL neither blocks the host: the wait orders the
        current stream after the reduce-scatter."""
        self.wait()
        flat = self.flat
        if flat.replicate_group is None or self.replicating:
            return
        self.replicating = True
        if self.divide_by != 1:
            self.out.div_(self.divide_by)
            self.divide_by = 1
        self.replicated = collectives.all_reduce(
            self.out, flat.replicate_group, kind="replicate_all_reduce", tag=flat.tag,
            async_op=True,
        )  # fmt: skip

    def finish(self) -> None:
        self.wait_and_replicate()
        if self.replicated is not None:
            self.replicated.wait()
        if self.divide_by != 1:
            self.out.div_(self.divide_by)
        self.flat.accumulate(self.out)
