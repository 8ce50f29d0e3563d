"""Replay fsdp_lite's step over a traced step: which full buffers, shard grads and
communication buffers exist at each mark, added to what the trace counted there.

Each term is one named line of the breakdown, each following one place of the code:

- ``shards``: every flat param's master shard (``FlatParam.shard``), all the time.
- ``optimizer_state``: per trainable shard element, the optimizer's states in the master
  dtype (AdamW: ``exp_avg``, ``exp_avg_sq``, plus a 4-byte ``step`` per shard on CPU).
- ``buffers``: the model's buffers on the compute device (``prepare_buffers``).
- ``gathered_units``: full buffers allocated now (``FlatParam.unshard`` .. ``reshard``):
  the running unit's, the prefetched ones' (``PrefetchPolicy``) and, by default, the root's,
  kept from forward (``schedule.build``).
- ``gather_buffers``: the shard cast to the compute dtype that an all-gather sends, kept
  until the gather is waited for (``FlatParam._gather_send``).
- ``full_gradients``: (traced) a unit's parameter gradients in the compute dtype until
  its post-backward reduce-scatters them (``FlatParam.take_grad``).
- ``reduce_scatter_buffers``: the full gradient cast to the reduce dtype, at the
  post-backward; and, on a real backend, what the process group keeps of the one
  reduce-scatter in flight until the next unit's post-backward waits for it
  (``Unit.reduce_grad``): the input itself (the cast, or the full
  gradient), which NCCL stashes and gloo all-reduces in place. The fake keeps nothing.
- ``gradients``: the reduce-scatter outputs (shard-sized, reduce dtype) in the root's
  queue (``reduce.InFlight``) until the next reduce-scatter is issued, then the fp32 shard
  grads they become (``PendingGrad.finish``; a copy where the reduce dtype is not the
  master dtype).
- ``activations``, ``backward_temporaries``: (traced) see ``planner/trace.py``.
- ``optimizer_temporaries``: what the optimizer step allocates: AdamW's ``denom`` (a square
  root and a quotient per shard, while the previous shard's ``denom`` is still held) or,
  with ``foreach`` (the default on CUDA), one square root per shard element at once.
- ``grad_accumulators``: with gradient accumulation unsynced (``no_sync`` or
  ``set_requires_gradient_sync(False)``), each trainable flat param's unsharded fp32
  gradient sum (``FlatParam.unsharded_grad``), from the first micro-batch's backward to
  the last one's reduce-scatter.

Gradient accumulation (``ReplayConfig.accumulation``) replays the two kinds of
micro-batch a step has, and takes the higher: one before the last (``"sync"``: the shard
grads of earlier micro-batches held throughout; ``"no_sync"``: accumulators instead of
reduce-scatters; ``"keep"``: as ``no_sync``, with every unit's full parameters gathered
throughout, ``Unit.accumulating``), and the last, which syncs as a plain step does while
the accumulators (and, with ``"keep"``, the kept units, until their post-backward) are
still held.

Shard grads are assumed freed before the next forward (``optimizer.zero_grad()``, which
sets them to ``None`` by default). Frozen flat params are taken as freed once their unit's
trainable ones are reduced (fsdp_lite also waits for the unit's input gradients), or at the
end of backward in a unit with nested units or with nothing trainable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fsdp_lite.core import reduce, schedule
from fsdp_lite.core.policies import PrefetchPolicy
from fsdp_lite.planner.layout import FlatLayout, UnitLayout
from fsdp_lite.planner.storage import CATEGORIES, Mark
from fsdp_lite.planner.trace import StepTrace

TERMS = (
    "shards",
    "optimizer_state",
    "buffers",
    "gathered_units",
    "gather_buffers",
    "activations",
    "full_gradients",
    "backward_temporaries",
    "reduce_scatter_buffers",
    "gradients",
    "optimizer_temporaries",
    "grad_accumulators",
)
# ReplayConfig.accumulation: None (one micro-batch a step), or how micro-batches before the
# last are run (see the module doc).
ACCUMULATION = (None, "sync", "no_sync", "keep")


@dataclass(frozen=True)
class ReplayConfig:
    reshard_after_forward: bool | None
    prefetch: PrefetchPolicy | None
    reduce_dtype: torch.dtype | None  # MixedPrecision's effective reduce dtype; None: master
    offload_to_host: bool  # shards, grads and optimizer state in host memory, apart
    optimizer_states: float  # states per trainable shard element
    optimizer_temporaries: str  # "none", "per_tensor" or "foreach" (see _optimizer_temporaries)
    step_tensors: bool  # a 4-byte step count per shard (Adam) in this memory
    # What the backend keeps for the reduce-scatter in flight: "input" (NCCL stashes it,
    # gloo all-reduces it in place), "copy" (a clone beside it), "none" (fake, one rank).
    comm_keeps: str
    accumulation: str | None = None  # one of ACCUMULATION


@dataclass
class Peak:
    bytes: int = -1
    breakdown: dict[str, int] = field(default_factory=dict)
    phase: str = ""
    host_bytes: int = 0  # offloaded state in host memory, when that is not the device's


class _Replay:
    def __init__(
        self, units: list[UnitLayout], trace: StepTrace, cfg: ReplayConfig, last: bool = True
    ) -> None:
        self.units, self.cfg = units, cfg
        trainable = [f for u in units for f in u.flats if f.requires_grad]
        states = cfg.optimizer_states * sum(f.shard_bytes for f in trainable)
        states += 4 * len(trainable) if cfg.step_tensors else 0
        unsynced = cfg.accumulation in ("no_sync", "keep")
        accumulators = sum(f.padded_numel * f.master_dtype.itemsize for f in trainable)
        self.resident = {
            "shards": sum(f.shard_bytes for u in units for f in u.flats),
            "optimizer_state": int(states),
            "buffers": trace.buffer_bytes,
            "grad_accumulators": accumulators if unsynced else 0,
        }
        # This micro-batch reduce-scatters its gradients (a plain step's, the last one's);
        # before the last, "keep" holds every unit gathered (Unit.accumulating).
        self.sync = last or not unsynced
        self.keep_all = cfg.accumulation == "keep" and not last
        self.temporaries = _optimizer_temporaries(trainable, cfg.optimizer_temporaries)
        self.gathered: set[tuple[int, int]] = set()  # (unit, flat)
        self.sends: dict[int, int] = {}  # unit -> its prefetch's send buffer, until waited
        self.outs = 0  # reduce-scatter outputs not yet added to their shard grads
        self.in_flight: list[tuple[int, int]] = []  # (unit, flat) issued, not yet added
        self.host_staged = 0  # offload: reduced grads copied to host during backward
        self.host_copies = 0  # offload: their fp32 copies at the end of backward
        self.held = 0  # the backend's buffer for the reduce-scatter in flight
        self.grads = 0  # fp32 shard grads
        self.with_grad: set[tuple[int, int]] = set()  # flat params whose shard grad exists
        self.host_at_end = 0  # offload: host bytes of grads while backward finishes
        if cfg.accumulation == "sync" and not cfg.offload_to_host:  # earlier micro-batches'
            self.with_grad = {
                (u, i) for u, unit in enumerate(units) for i, f in enumerate(unit.flats)
                if f.requires_grad
            }  # fmt: skip
            self.grads = sum(f.shard_bytes for f in trainable)
        self.forward_order: list[int] = []  # units whose forward ran in this pass
        self.recorded_forward = [m.unit for m in _firsts(trace.marks, "pre_forward")]
        self.backward_order = [m.unit for m in _firsts(trace.marks, "pre_backward")]
        # The step's schedule for the traced orders, built as the root builds it.
        root = next(i for i, u in enumerate(units) if u.is_root)
        self.schedule = schedule.build(
            range(len(units)), root, lambda u: cfg.reshard_after_forward,
            self.recorded_forward, self.backward_order, cfg.prefetch,
        )  # fmt: skip
        self.started: set[int] = set()  # units whose backward began
        self.reduced: set[tuple[int, int]] = set()
        self.peak = Peak()
        if cfg.accumulation == "keep":  # gathered at the step's first forward, kept since
            self.gathered = {(u, i) for u, unit in enumerate(units) for i in range(len(unit.flats))}

    # -- the state as breakdown terms ---------------------------------------------------

    def consider(self, traced: dict[str, int], phase: str, **extra: int) -> None:
        terms = dict.fromkeys(TERMS, 0)
        if not self.cfg.offload_to_host:
            terms.update(self.resident)
        else:
            terms["buffers"] = self.resident["buffers"]
        terms["gathered_units"] = sum(self._flat(u, f).full_bytes for u, f in self.gathered)
        terms["gather_buffers"] = sum(self.sends.values())
        terms["reduce_scatter_buffers"] = self.held
        terms["gradients"] = self.outs + (0 if self.cfg.offload_to_host else self.grads)
        for key in CATEGORIES:
            terms[key] += traced.get(key, 0)
        for key, value in extra.items():
            terms[key] += value
        total = sum(terms.values())
        if total > self.peak.bytes:
            self.peak = Peak(total, terms, phase)

    def _flat(self, unit: int, flat: int) -> FlatLayout:
        return self.units[unit].flats[flat]

    def _send_bytes(self, unit: int) -> int:
        """The all-gather's send buffer: the shard cast to the compute dtype (or copied to
        the device from host memory), nothing when the shard itself can be sent."""
        total = 0
        for f in self.units[unit].flats:
            if f.compute_dtype != f.master_dtype or self.cfg.offload_to_host:
                total += f.shard_numel * f.compute_dtype.itemsize
        return total

    def _gather(self, unit: int) -> int:
        """Allocate ``unit``'s full buffers; returns its send buffers' bytes (0 if it was
        already gathered)."""
        flats = [(unit, i) for i in range(len(self.units[unit].flats))]
        if all(key in self.gathered for key in flats):
            return 0
        self.gathered.update(flats)
        return self._send_bytes(unit)

    def _reshard(self, unit: int, only_frozen: bool = False) -> None:
        if self.keep_all:
            return
        for i, f in enumerate(self.units[unit].flats):
            if not only_frozen or not f.requires_grad:
                self.gathered.discard((unit, i))

    def _reduce_dtype(self, flat: FlatLayout) -> torch.dtype:
        return self.cfg.reduce_dtype or flat.master_dtype

    def _finish(self, key: tuple[int, int], traced: dict[str, int], label: str) -> None:
        """``PendingGrad.finish``: the output added to its shard grad (through an fp32 copy
        where the reduce dtype is not the master dtype), then freed; offloaded, copied to
        the host and added there at the end of backward."""
        flat = self._flat(*key)
        reduce_dtype = self._reduce_dtype(flat)
        copy = flat.shard_bytes if reduce_dtype != flat.master_dtype else 0
        if self.cfg.offload_to_host:
            self.host_staged += flat.shard_numel * reduce_dtype.itemsize
            self.host_copies += copy
        elif copy:
            self.consider(traced, label, gradients=copy)
        if key not in self.with_grad:
            self.with_grad.add(key)
            self.grads += flat.shard_bytes
        self.outs -= flat.shard_numel * reduce_dtype.itemsize


def replay(units: list[UnitLayout], trace: StepTrace, cfg: ReplayConfig) -> Peak:
    """The highest point of the step (forward, backward, end of backward, optimizer step);
    with gradient accumulation, of a micro-batch before the last and of the last."""
    if cfg.accumulation not in ACCUMULATION:
        raise ValueError(f"accumulation must be one of {ACCUMULATION}, got {cfg.accumulation!r}")
    last = _replay_one(units, trace, cfg, last=True)
    if cfg.accumulation is None:
        return last
    before = _replay_one(units, trace, cfg, last=False)
    if before.bytes > last.bytes:
        before.phase = f"a micro-batch before the last: {before.phase}"
        before.host_bytes = max(before.host_bytes, last.host_bytes)
        return before
    return last


def _replay_one(units: list[UnitLayout], trace: StepTrace, cfg: ReplayConfig, last: bool) -> Peak:
    r = _Replay(units, trace, cfg, last)
    for mark in trace.marks:
        name = units[mark.unit].name if mark.unit >= 0 else ""
        label = _apply(r, mark, name)
        r.consider(mark.peak_after, label)
    final = trace.marks[-1].at
    if last:
        on_device = 0 if cfg.offload_to_host else r.temporaries  # offloaded: on the host
        r.resident["grad_accumulators"] = 0  # reduced by the last backward
        r.consider(final, "optimizer step", optimizer_temporaries=on_device)
    if cfg.offload_to_host:
        host = r.resident["shards"] + r.resident["optimizer_state"]
        r.peak.host_bytes = host + max(r.host_at_end, r.grads + r.temporaries)
    return r.peak


def _apply(r: _Replay, mark: Mark, name: str) -> str:
    """Move the replay past ``mark`` (considering any spike inside it); returns the label
    of the interval after it."""
    kind, unit = mark.kind, mark.unit
    if kind == "pre_forward":
        _pre_forward(r, mark)
        return f"forward of {name}"
    if kind == "post_forward":
        if not _keeps_full(r, unit):
            r._reshard(unit)
        if r.units[unit].is_root:  # Root._end_forward: drop unused prefetches
            for other in [u for u in r.sends if u not in r.forward_order]:
                r._reshard(other)
                del r.sends[other]
        return f"forward, after {name}"
    if kind == "pre_backward":
        if unit not in r.started:
            _pre_backward(r, mark)
        return f"backward of {name}"
    if kind == "post_backward":
        _post_backward(r, mark, name)
        return f"backward, after the reduce-scatter of {name}"
    if kind == "end":
        _end_of_backward(r, mark)
        return "end of backward"
    return "start of forward"


def _pre_forward(r: _Replay, mark: Mark) -> None:
    r.forward_order.append(mark.unit)
    own = r.sends.pop(mark.unit, 0) + r._gather(mark.unit)
    _prefetch(r, mark.unit, r.recorded_forward, backward=False)
    r.consider(mark.at, f"forward of {r.units[mark.unit].name} (gathering)", gather_buffers=own)


def _pre_backward(r: _Replay, mark: Mark) -> None:
    r.started.add(mark.unit)
    own = r.sends.pop(mark.unit, 0) + r._gather(mark.unit)
    _prefetch(r, mark.unit, r.backward_order, backward=True)
    r.consider(mark.at, f"backward of {r.units[mark.unit].name} (gathering)", gather_buffers=own)


def _prefetch(r: _Replay, unit: int, order: list[int], backward: bool) -> None:
    """``Root._unshard``: gather the units the schedule prefetches at ``unit``'s position
    in ``order`` (in backward, not one whose backward began), each send buffer held until
    its unit waits."""
    for other in r.schedule.prefetches(order.index(unit), backward):
        if backward and other in r.started:
            continue
        send = r._gather(other)
        if send:
            r.sends[other] = send


def _keeps_full(r: _Replay, unit: int) -> bool:
    """Does ``unit`` keep its full parameters after forward (the steady state's schedule)?"""
    return unit in r.schedule.keeps_full


def _post_backward(r: _Replay, mark: Mark, name: str) -> None:
    """``Unit.post_backward``: the full buffer freed first, then the gradient (cast to the
    reduce dtype, in pieces where it widens: ``reduce.reduce_scatter``)."""
    flat = r._flat(mark.unit, mark.flat)
    if not r.sync:  # FlatParam.accumulate_unsharded: added in place into the accumulator
        if not r.keep_all:
            r.gathered.discard((mark.unit, mark.flat))
        return
    reduce_dtype = r._reduce_dtype(flat)
    r.gathered.discard((mark.unit, mark.flat))
    r.held = 0  # wait_previous_reduce_scatter
    out = flat.shard_numel * reduce_dtype.itemsize
    wide = flat.padded_numel * reduce_dtype.itemsize
    even = flat.rank_numel is None  # whole params: per-rank sizes
    pieces = reduce.reduce_pieces(flat.padded_numel, flat.compute_dtype, reduce_dtype, even)
    keeps = r.cfg.comm_keeps
    kept = (wide if pieces == 1 else 0) if keeps != "none" else 0
    copy = kept if keeps == "copy" else 0  # beside the input
    label = f"backward of {name} (reduce-scatter)"
    if reduce_dtype == flat.compute_dtype:  # the full gradient itself is reduced
        r.consider(mark.at, label, reduce_scatter_buffers=copy, gradients=out)
    elif pieces > 1:  # a piece at a time beside the gradient (two with a real backend)
        piece = -(-flat.shard_numel // pieces) * flat.world_size * reduce_dtype.itemsize
        in_flight = piece * (1 if keeps == "none" else 2)
        r.consider(mark.at, label, reduce_scatter_buffers=in_flight, gradients=out)
    else:  # cast, then the compute-dtype gradient is dropped before the output is made
        r.consider(mark.at, label, reduce_scatter_buffers=wide)
        r.consider(
            mark.at, label, full_gradients=-flat.full_bytes, reduce_scatter_buffers=wide + copy,
            gradients=out,
        )  # fmt: skip
    r.outs += out
    if r.resident["grad_accumulators"]:  # the last micro-batch reduced this one's sum
        r.resident["grad_accumulators"] -= flat.padded_numel * flat.master_dtype.itemsize
    r.held = kept
    for key in r.in_flight:  # InFlight.issue: the one before is added to its shard grad
        r._finish(key, mark.at, label)
    r.in_flight = [(mark.unit, mark.flat)]
    r.reduced.add((mark.unit, mark.flat))
    unit = r.units[mark.unit]
    trainable = [(mark.unit, i) for i, f in enumerate(unit.flats) if f.requires_grad]
    if not unit.has_nested and all(key in r.reduced for key in trainable):
        r._reshard(mark.unit, only_frozen=True)  # frozen params freed once backward is done


def _end_of_backward(r: _Replay, mark: Mark) -> None:
    """``Root.finish_backward``: the last reduce-scatter waited for, its result into its
    shard grad; offloaded grads added on the host; every unit resharded."""
    r.held = 0
    for key in r.in_flight:
        r._finish(key, mark.at, "end of backward (shard grads)")
    r.in_flight = []
    if r.cfg.offload_to_host:
        r.host_at_end = r.host_staged + r.host_copies
    if not r.keep_all:
        r.gathered.clear()
    r.sends.clear()


def _firsts(marks: list[Mark], kind: str) -> list[Mark]:
    seen: set[int] = set()
    out = []
    for m in marks:
        if m.kind == kind and m.unit not in seen:
            seen.add(m.unit)
            out.append(m)
    return out


def _optimizer_temporaries(trainable: list[FlatLayout], kind: str) -> int:
    """``trainable`` in the optimizer's order (``model.parameters()`` of the wrapped model:
    the root's shards, then each unit's in module order)."""
    if not trainable or kind == "none":
        return 0
    if kind == "foreach":  # _multi_tensor_adam: one sqrt per shard element, all at once
        return sum(f.shard_bytes for f in trainable)
    # _single_tensor_adam: denom = (exp_avg_sq.sqrt() / c).add_(eps), per shard; the
    # previous shard's denom is dropped only once the new one is assigned.
    sizes = [0] + [f.shard_bytes for f in trainable]
    return max(prev + 2 * cur for prev, cur in zip(sizes, sizes[1:], strict=False))
