"""Flat parameters: flatten, pad, shard, gather into a full buffer, point views at it.

[Note: one full buffer for the life of the unit]
Autograd saves views of the full parameters for backward. A ``FlatParam`` therefore
keeps *one* full-buffer tensor forever: resharding frees its storage with
``untyped_storage().resize_(0)`` and unsharding re-allocates the same storage and
gathers into it, so views (and tensors saved for backward) stay valid. Collectives
write through ``full_data``, a second tensor on the same storage with its own version
counter, so the in-place gather does not trip autograd's saved-tensor version check;
``full`` is the autograd leaf the module's parameter views are taken from.

[Note: what a module's parameter attribute is between steps]
While a unit's full buffer is allocated, each original parameter location holds a view of
it. Whenever the buffer is freed (and before the first gather) each location holds a
:class:`FreedParameter` instead: shape, dtype and device answer, and any computation
raises an error naming ``summon_full_params``, never reads freed storage. A full buffer
kept from a forward (the root's, ``reshard_after_forward=False``) lives until that forward's
backward ends or the next root forward begins (``Root._free_kept``): it is never gathered
"again if stale", so nothing needs to tell whether the shard changed.
"""

from __future__ import annotations

import bisect
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_lite.core import accounting, collectives
from fsdp_lite.core.home import DeviceHome

# Every shard nn.Parameter carries (ranks it is a slice of, replicas its grad is averaged
# over too), so code that sees only parameters -- an optimizer's step hooks, the grad
# scaler, the misuse checks -- tells shards from plain parameters without the unit tree.
_SHARD_ATTR = "_fsdp_lite_ranks"
# An orig param of a flat param cut at numel/W (use_orig_params without whole_params)
# carries its parameter's shape: on some rank it is, or may be, a partial piece.
_CUT_ATTR = "_fsdp_lite_cut_from"


def shard_ranks(p: torch.Tensor) -> tuple[int, int] | None:
    """``(shard group size, replicas)`` if ``p`` is an fsdp_lite shard, else ``None``."""
    return p.__dict__.get(_SHARD_ATTR)


def unaveraged(params: list[nn.Parameter], modules: Iterator[nn.Module]) -> list[int]:
    """Indices of the trainable ``params`` whose gradients nothing averages across ranks:
    not an fsdp_lite shard, nor a parameter of a ``DistributedDataParallel`` module among
    ``modules`` (which averages its own). The one rule of the forward and optimizer checks."""
    ddp = {
        id(p)
        for m in modules
        if isinstance(m, nn.parallel.DistributedDataParallel)
        for p in m.parameters()
    }
    return [
        i
        for i, p in enumerate(params)
        if p.requires_grad and shard_ranks(p) is None and id(p) not in ddp
    ]


# A freed parameter's device properties, answered for its real device (a constant).
_DEVICE_FLAGS = types.MappingProxyType(
    {
        torch._C.TensorBase.is_meta: "meta",
        torch._C.TensorBase.is_cuda: "cuda",
        torch._C.TensorBase.is_cpu: "cpu",
    }
)


class FreedParameter(torch.Tensor):
    """What a parameter location holds while its unit's full buffer is freed (see Note):
    shape, dtype and device answer; any computation raises ``message``."""

    message = "{op}"  # the error, with ``{op}`` for the function that was called
    real_device = torch.device("cpu")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        attribute = getattr(func, "__self__", None)  # a property's descriptor, for its getter
        if attribute is torch._C.TensorBase.device:
            return args[0].real_device
        if attribute in _DEVICE_FLAGS:  # what the real device answers, not the meta tensor
            return args[0].real_device.type == _DEVICE_FLAGS[attribute]
        if attribute is torch._C.TensorBase.data:  # a write through it would reach nothing
            raise RuntimeError(args[0].message.format(op=".data"))
        if getattr(func, "__name__", "") == "__get__" or func is torch.Tensor.__repr__:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        freed = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, FreedParameter)]
        message = freed[0].message if freed else cls.message
        raise RuntimeError(message.format(op=getattr(func, "__name__", func)))


def freed_parameter(
    shape: torch.Size, dtype: torch.dtype, device: torch.device, message: str
) -> FreedParameter:
    t = torch.Tensor._make_subclass(FreedParameter, torch.empty(shape, dtype=dtype, device="meta"))
    t.message, t.real_device = message, device
    return t


def _between_steps_message(name: str, unit: str) -> str:
    return (
        f"fsdp_lite: {{op}} on parameter '{name}' of unit {unit}, whose full value exists "
        "on no rank here (between steps each rank keeps only its 1/W fp32 shard, which "
        "model.parameters() yields; full parameters exist only inside the unit's forward and "
        "backward). Read or change full parameters inside `with model.summon_full_params():` "
        "or through model.state_dict() / load_state_dict(); set requires_grad before wrapping."
    )


@dataclass
class ParamSlot:
    """One original parameter inside a flat param."""

    locations: list[tuple[nn.Module, str]]  # every (module, attribute) it was registered at
    name: str  # a readable name, for errors
    shape: torch.Size
    numel: int
    offset: int  # into the unpadded flat param


class FlatParam:
    """Parameters of one unit sharing dtype, requires_grad and compute dtype."""

    def __init__(
        self,
        slots: list[ParamSlot],
        originals: list[nn.Parameter],
        *,
        group: collectives.ProcessGroup,
        device: torch.device,
        compute_dtype: torch.dtype,
        home: DeviceHome,
        replicate_group: collectives.ProcessGroup | None = None,
        sync: bool = False,
        owners: list[int] | None = None,
    ) -> None:
        self.slots = slots
        self.group = group
        # Where gradients are reduce-scattered: ``group``, or a second group over the same
        # ranks (FSDPModule.set_separate_reduce_scatter_group).
        self.reduce_group = group
        self.world_size = collectives.world_size(group)
        self.rank = collectives.rank(group)
        # Hybrid sharding: shard grads are averaged over this group after the reduce-scatter.
        self.replicate_group = replicate_group
        self.replicas = collectives.world_size(replicate_group) if replicate_group else 1
        self.compute_dtype = compute_dtype
        self.requires_grad = originals[0].requires_grad
        self.numel = sum(s.numel for s in slots)  # unpadded
        self._lay_out(owners)
        # Weak references to the original parameters, so an enclosing unit can tell
        # that a parameter it meets was already flattened here (a tie across units).
        self.original_refs = [weakref.ref(p) for p in originals]

        with torch.no_grad():
            shard = _build_shard(self, originals, sync, device)
        # The master copy: the only tensor an optimizer sees.  shape: (shard_numel,)
        self.shard = nn.Parameter(shard, requires_grad=self.requires_grad)
        self.shard.__dict__[_SHARD_ATTR] = (self.world_size, self.replicas)  # see shard_ranks
        # Where the shard and its grad live between uses (device, CPU or files).
        self.home = home
        self.device = device  # the compute device
        home.place(self.shard)
        # Where collectives write the gathered params.  shape: (padded_numel,), storage
        # resized to 0 while resharded. Created at the first gather (nothing is allocated
        # at wrap time), then kept for the life of the unit.
        self.full_data: torch.Tensor | None = None
        # The autograd leaf the module's views hang off; same storage as full_data.
        self.full: torch.Tensor | None = None
        # Called with the full gradient once it is complete (the unit's post-backward).
        self.post_accumulate_hook: Callable[[torch.Tensor], None] | None = None
        # fp32 sum of gradients kept unreduced under no_sync.  shape: (padded_numel,)
        self.unsharded_grad: torch.Tensor | None = None
        # An all-gather in flight into full_data, and its send buffer (kept alive until done).
        self._gather: collectives.Handle | None = None
        self._gather_send: torch.Tensor | None = None
        # Accounting: the owning unit's name (set at lazy init) and identity.
        self.unit_name: str | None = None
        self.unit_key = 0
        # One FreedParameter per slot, at its locations whenever full_data is freed.
        self.placeholders: list[FreedParameter] | None = None
        # This iteration's views of ``full``, one per slot (use_full_views), for backward.
        self.views: list[torch.Tensor] | None = None
        # use_orig_params / whole_params: what the optimizer sees instead of the shard (see
        # make_orig_params), and the shard grad their grads were last pointed into.
        self.orig_params: list[OrigParam] | None = None
        self._linked_grad: weakref.ref | None = None
        self._linked_views: list[weakref.ref] | None = None
        self.warned_thawed = False  # an orig param of a frozen flat param set trainable

    def _lay_out(self, owners: list[int] | None) -> None:
        """Rank r keeps elements ``[bounds[r], bounds[r + 1])`` of the padded flat param: a
        ``ceil(numel / W)`` slice each, or (whole params) the slots ``owners`` gives it."""
        self.whole = owners is not None  # cut on parameter boundaries
        if owners is None:
            self.bounds = _even_bounds(self.numel, self.world_size)
        else:
            self.bounds = _slot_bounds(self.slots, owners, self.world_size)
        self.padded_numel = self.bounds[-1]
        self.shard_numel = self.bounds[self.rank + 1] - self.bounds[self.rank]
        # Each rank's shard size where they differ (collectives then take per-rank sizes).
        sizes = [b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False)]
        self.sizes = sizes if len(set(sizes)) > 1 else None

    # -- storage -----------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return self.full_data is not None and self.full_data.untyped_storage().size() > 0

    @property
    def full_nbytes(self) -> int:
        return self.padded_numel * self.compute_dtype.itemsize

    def _allocate_full(self) -> None:
        if self.full_data is None:
            self.full_data = torch.empty(
                self.padded_numel, dtype=self.compute_dtype, device=self.device
            )
            self.full = torch.empty(0, dtype=self.compute_dtype, device=self.device)
            self.full.data = self.full_data
            self.full.requires_grad_(self.requires_grad)
            if self.requires_grad and self.post_accumulate_hook is not None:
                self.full.register_post_accumulate_grad_hook(self.post_accumulate_hook)
        else:
            self.full_data.untyped_storage().resize_(self.full_nbytes)

    def unshard(self, async_op: bool = False) -> None:
        """Cast the shard to the compute dtype and all-gather it into the full buffer.

        With ``async_op`` the gather is only issued (a prefetch); :meth:`wait_unshard`
        completes it. A no-op when the full buffer is already allocated or in flight.
        """
        if self.is_unsharded:
            if not async_op:
                self.wait_unshard()
            return
        self._allocate_full()
        accounting.full_allocated(id(self), self.unit_key, self.full_nbytes)
        with torch.no_grad():
            send = self.home.shard_for_gather(self.shard).to(self.compute_dtype)
            self._gather = collectives.all_gather_flat(
                self.full_data, send, self.group, async_op=True, unit=self.unit_name,
                sizes=self.sizes,
            )  # fmt: skip
        self._gather_send = send
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self._gather is not None:
            self._gather.wait()
            self._gather = self._gather_send = None
            self.home.after_gather(self.shard)

    def reshard(self) -> None:
        """Free the full buffer's storage; the parameter locations get placeholders (the
        views stay valid objects for autograd, pointing at nothing)."""
        if self.is_unsharded:
            self.wait_unshard()  # never free memory a collective is still writing
            self.full_data.untyped_storage().resize_(0)
            accounting.full_freed(id(self), self.unit_key)
            self.use_placeholders()

    def gather_fp32(self, source: torch.Tensor | None = None) -> torch.Tensor:
        """A new unpadded full copy of ``source`` (default: the master shard) from every rank.

        ``source`` is shard-shaped, e.g. ``shard.grad``; the result has the shard's dtype.
        """
        with torch.no_grad():
            fetched = source is None
            source = self.home.shard_for_gather(self.shard) if fetched else source.detach()
            source = source.to(self.device, self.shard.dtype)
            out = torch.empty(self.padded_numel, dtype=self.shard.dtype, device=self.device)
            collectives.all_gather_flat(out, source, self.group, sizes=self.sizes)
            if fetched:
                self.home.after_gather(self.shard)
        return out[: self.numel]

    def use_full_views(self) -> None:
        """Point every original parameter location at its view of the full buffer.

        One ``split`` (not a slice per parameter): its backward is a single ``cat`` into
        the full gradient, where per-parameter slices would each build a zero-filled
        full-size gradient and add them all up.

        New views every forward, never kept ones: the autograd engine runs ready nodes
        newest first, so a split node kept from an earlier step would run last, holding
        every unit's full gradient (and its reduce-scatter) until the end of backward.
        """
        sizes = [slot.numel for slot in self.slots] + [self.padded_numel - self.numel]
        pieces = torch.split(self.full, sizes)
        self.views = [
            piece.view(slot.shape) for slot, piece in zip(self.slots, pieces, strict=False)
        ]
        self._install(self.views)

    def use_views_again(self) -> None:
        """In backward: this iteration's views back at their locations, for a recompute
        that reads the module's attributes without passing through the unit's hooks (a
        checkpointed module inside the unit)."""
        if self.views is not None:
            self._install(self.views)

    def _install(self, tensors: list[torch.Tensor]) -> None:
        """``tensors[i]`` at every location of slot i. An attribute this installed before is
        replaced in the module's ``__dict__``, as ``nn.Module.__setattr__`` would for a
        plain tensor, without its checks."""
        for slot, tensor in zip(self.slots, tensors, strict=True):
            for module, attr in slot.locations:
                attrs = module.__dict__
                if attr in attrs:
                    attrs[attr] = tensor
                else:  # the first install, or after a summon put a Parameter there
                    setattr(module, attr, tensor)

    def use_placeholders(self) -> None:
        """A :class:`FreedParameter` at every original location (see Note); made once."""
        if self.placeholders is None:
            unit = self.unit_name or "<not yet run>"
            self.placeholders = [
                freed_parameter(
                    slot.shape,
                    self.compute_dtype,
                    self.device,
                    _between_steps_message(slot.name, unit),
                )
                for slot in self.slots
            ]
        self._install(self.placeholders)

    def rank_range(self, rank: int | None = None) -> tuple[int, int]:
        """``[start, end)``: the elements of the padded flat param that ``rank`` (default:
        this rank) keeps in its shard."""
        rank = self.rank if rank is None else rank
        return self.bounds[rank], self.bounds[rank + 1]

    def owner(self, offset: int) -> int:
        """The rank whose shard holds element ``offset`` of the flat param."""
        return bisect.bisect_right(self.bounds, offset) - 1

    def pieces(self, rank: int | None = None) -> Iterator[tuple[int, int, int, int]]:
        """``(slot index, lo, hi, at)``: elements ``[lo, hi)`` of that slot's flattened
        value live at ``shard[at : at + hi - lo]`` on ``rank`` (default: this rank).

        Worked example, W=2, slots a (6 elements) and b (3), shard_numel 5: rank 0 holds
        ``(0, 0, 5, 0)``; rank 1 holds ``(0, 5, 6, 0)`` and ``(1, 0, 3, 1)``, then 1 padding.
        """
        start, end = self.rank_range(rank)
        for i, slot in enumerate(self.slots):
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                yield i, lo - slot.offset, hi - slot.offset, lo - start

    # -- what the optimizer sees ----------------------------------------------------

    def make_orig_params(self) -> list[OrigParam]:
        """use_orig_params: one ``nn.Parameter`` per piece of an original parameter this
        rank holds, a view of the shard (see Note). A whole piece has the parameter's
        shape; a partial one is 1-D with leading 1s up to the parameter's ndim (so
        ``p.ndim`` sorts parameters into groups). Without whole params every one is
        marked for ``cut_from`` (some rank holds a partial piece of it, or may)."""
        origs = []
        with torch.no_grad():
            for i, lo, hi, at in self.pieces():
                slot, numel = self.slots[i], hi - lo
                whole = numel == slot.numel
                shape = slot.shape if whole else (1,) * (len(slot.shape) - 1) + (numel,)
                view = self.shard[at : at + numel].view(shape)
                param = nn.Parameter(view, requires_grad=self.requires_grad)
                param.__dict__[_SHARD_ATTR] = (self.world_size, self.replicas)
                if not self.whole:
                    param.__dict__[_CUT_ATTR] = slot.shape
                origs.append(OrigParam(slot.name, i, at, numel, param))
        self.orig_params = origs
        return origs

    def optimizer_params(self) -> list[nn.Parameter]:
        """What an optimizer over this flat param steps: its orig params, else the shard."""
        if self.orig_params is None:
            return [self.shard]
        return [o.param for o in self.orig_params]

    def grads(self) -> list[torch.Tensor]:
        """The gradients an optimizer over this flat param would step: the shard's, or
        each orig param's that is not None (what clipping scales and norms count)."""
        if self.orig_params is None:
            return [] if self.shard.grad is None else [self.shard.grad]
        return [g for o in self.orig_params if (g := o.param.grad) is not None]

    def grad_as_shard(self) -> torch.Tensor | None:
        """The gradients as one shard-shaped tensor (zeros where an orig param has none),
        for reading; None where there are none."""
        if self.orig_params is None:
            return self.shard.grad
        if not self.grads():
            return None
        out = torch.zeros_like(self.shard.detach())
        for o in self.orig_params:
            if o.param.grad is not None:
                out[o.at : o.at + o.numel].copy_(o.param.grad.reshape(-1))
        return out

    def _fold_orig_grads(self) -> torch.Tensor | None:
        """Before an accumulation: the shard grad as the orig params' grads define it.

        Between backwards the orig params' grads are views of one shard-shaped tensor that
        only they hold (this keeps weak references), so ``zero_grad(set_to_none=True)``
        frees it as it would a plain model's grads. If every one is still that view, it is
        accumulated into in place (as torch accumulates into ``p.grad``); if every one is
        None, a new one is made; otherwise a new one is filled from their grads (None:
        zero; an assigned tensor: its values), never writing into a tensor the user may
        still hold."""
        linked = _deref(self._linked_grad)
        views = [_deref(v) for v in self._linked_views or ()]
        current = [o.param.grad for o in self.orig_params]
        frozen = [not o.param.requires_grad for o in self.orig_params]  # linked to none
        if linked is not None and all(
            (f and g is None) or (v is not None and g is v)
            for g, v, f in zip(current, views, frozen, strict=True)
        ):
            return linked
        if all(g is None for g in current):
            return None
        fresh = torch.zeros_like(self.shard.detach())
        with torch.no_grad():
            for o, g in zip(self.orig_params, current, strict=True):
                if g is not None:
                    fresh[o.at : o.at + o.numel].copy_(g.reshape(-1))
        return fresh

    def link_orig_grads(self) -> None:
        """End of backward: point each trainable orig param's grad at its region of the
        shard grad, which then only they hold. A piece whose ``requires_grad`` was turned
        off after wrapping gets none, so no optimizer steps it."""
        if self.orig_params is None or self.shard.grad is None:
            return
        grad, self.shard.grad = self.shard.grad, None
        views = [grad[o.at : o.at + o.numel].view(o.param.shape) for o in self.orig_params]
        for o, view in zip(self.orig_params, views, strict=True):
            o.param.grad = view if o.param.requires_grad else None
        self._linked_grad = weakref.ref(grad)
        self._linked_views = [weakref.ref(v) for v in views]

    def accumulate(self, grad: torch.Tensor) -> None:
        """Add a reduced shard grad (compute device, reduce dtype) to the shard's fp32 grad,
        in its home (orig params: linked again at the end of backward)."""
        if self.orig_params is not None and self.shard.grad is None:
            self.shard.grad = self._fold_orig_grads()
        self.home.accumulate_grad(self.shard, grad)

    def load_full(self, flat: torch.Tensor) -> None:
        """Overwrite this rank's shard from an unpadded full flat tensor (no communication)."""
        start, end = self.rank_range()
        piece = flat[start : min(end, self.numel)]
        self.home.before_host_write(self.shard)
        with torch.no_grad():
            self.shard.zero_()
            self.shard[: piece.numel()].copy_(piece)

    # -- gradients ---------------------------------------------------------------

    def take_grad(self) -> torch.Tensor | None:
        """Detach the full gradient from ``full`` (plus any no_sync accumulation), fp32-or-low."""
        grad = None
        if self.full is not None:
            grad, self.full.grad = self.full.grad, None
        if self.unsharded_grad is not None:
            acc, self.unsharded_grad = self.unsharded_grad, None
            grad = acc if grad is None else acc.add_(grad)
        return grad

    def has_leftover_grad(self, sync: bool) -> bool:
        """At the end of backward: a gradient left in ``full.grad`` (or, when ``sync``,
        kept unreduced under no_sync) that this backward's post-backward did not take."""
        if self.full is not None and self.full.grad is not None:
            return True
        return sync and self.unsharded_grad is not None

    def accumulate_unsharded(self) -> None:
        """no_sync: fold this backward's full gradient into an fp32 accumulator."""
        grad = self.take_grad()
        if grad is not None:
            self.unsharded_grad = grad.to(self.shard.dtype)

    def reduce_scatter_grad(self, reduce_dtype: torch.dtype) -> PendingGrad | None:
        """Start the averaging reduce-scatter of this backward's gradient."""
        grad = self.take_grad()
        if grad is None:
            return None
        ranks = self.world_size * self.replicas  # averaged over
        with torch.no_grad():
            pieces = widening_pieces(grad.numel(), grad.dtype, reduce_dtype)
            if pieces > 1 and self.sizes is None:  # by columns of the (W, shard) layout
                out = torch.empty(self.shard_numel, dtype=reduce_dtype, device=grad.device)
                return PendingGrad(self, self._reduce_widened(grad, out, pieces), out, ranks)
            grad = grad.to(reduce_dtype)  # the compute-dtype gradient is dropped here
            # In fp32, divide only the 1/W-sized result (one full-size pass saved); in low
            # precision, part before the sum and part after (see predivide_factor).
            pre = predivide_factor(ranks, reduce_dtype)
            if pre != 1:
                grad.div_(pre)
            out = torch.empty(self.shard_numel, dtype=reduce_dtype, device=grad.device)
            work = collectives.reduce_scatter_flat(
                out, grad, self.reduce_group, unit=self.unit_name, sizes=self.sizes
            )
        return PendingGrad(self, [work], out, ranks / pre)

    def _reduce_widened(
        self, grad: torch.Tensor, out: torch.Tensor, pieces: int
    ) -> list[collectives.Handle]:
        """Reduce-scatter a low-precision ``grad`` in a wider dtype, a slice of columns of
        its (W, shard) layout at a time, so the wide copy never exists whole (see
        WIDEN_PIECE_BYTES); at most two pieces in flight."""
        columns = grad.view(self.world_size, self.shard_numel)
        step = -(-self.shard_numel // pieces)
        works: list[collectives.Handle] = []
        for lo in range(0, self.shard_numel, step):
            hi = min(lo + step, self.shard_numel)
            if len(works) >= 2:
                works[-2].wait()
            wide = torch.empty((self.world_size, hi - lo), dtype=out.dtype, device=grad.device)
            wide.copy_(columns[:, lo:hi])
            works.append(
                collectives.reduce_scatter_flat(
                    out[lo:hi], wide.view(-1), self.reduce_group, unit=self.unit_name
                )
            )
        return works


# A gradient reduced in a wider dtype than its own (bf16 compute, fp32 reduction) needs a
# wide copy twice its size. Above this many bytes that copy is made and reduce-scattered
# in pieces of at most this size, so a large unit's gradient (a 50k-token embedding) needs
# little more than itself at its reduce-scatter.
WIDEN_PIECE_BYTES = 64 * 2**20


def widening_pieces(numel: int, grad_dtype: torch.dtype, reduce_dtype: torch.dtype) -> int:
    """How many pieces a gradient of ``numel`` elements is reduce-scattered in (1: whole)."""
    if reduce_dtype.itemsize <= grad_dtype.itemsize:
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


def _build_shard(
    flat: FlatParam, originals: list[nn.Parameter], sync: bool, device: torch.device
) -> torch.Tensor:
    """This rank's slice of the padded flat param, in the master dtype. Without ``sync`` it
    is copied straight from the originals, so no full-size flat buffer is ever allocated."""
    dtype = master_dtype(originals[0].dtype)
    start, end = flat.rank_range()
    if sync:  # sync_module_states: every rank starts from rank 0's values
        full = torch.zeros(flat.padded_numel, dtype=dtype, device=device)
        for slot, p in zip(flat.slots, originals, strict=True):
            full[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
        collectives.broadcast_from_first(full, [flat.replicate_group, flat.group])
        return full[start:end].clone()
    shard = torch.zeros(flat.shard_numel, dtype=dtype, device=device)
    for slot, p in zip(flat.slots, originals, strict=True):
        lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
        if lo < hi:
            piece = p.detach().reshape(-1)[lo - slot.offset : hi - slot.offset]
            shard[lo - start : hi - start].copy_(piece)
    return shard


def _deref(ref: weakref.ref | None) -> Any:
    return None if ref is None else ref()


def _even_bounds(numel: int, world_size: int) -> list[int]:
    """Rank r keeps [r * s, (r + 1) * s) of the flat param padded to W * s, s = ceil(numel / W)."""
    per = -(-numel // world_size)
    return [r * per for r in range(world_size + 1)]


def _slot_bounds(slots: list[ParamSlot], owners: list[int], world_size: int) -> list[int]:
    """Whole params: rank r keeps the slots ``owners`` gives it, laid out consecutively in
    rank order (``slots`` is sorted by owner); no padding."""
    if owners != sorted(owners):
        raise ValueError("whole_params: slots must be laid out in owner order")
    bounds = [0] * (world_size + 1)
    for slot, owner in zip(slots, owners, strict=True):
        bounds[owner + 1] = slot.offset + slot.numel
    for r in range(1, world_size + 1):
        bounds[r] = max(bounds[r], bounds[r - 1])
    return bounds


def cut_from(p: torch.Tensor) -> torch.Size | None:
    """The original shape of ``p`` if it is an orig param of a flat param cut at numel/W
    (use_orig_params without whole_params: the same answer on every rank), else None."""
    return p.__dict__.get(_CUT_ATTR)


@dataclass
class OrigParam:
    """One original parameter's piece on this rank, as the optimizer sees it."""

    name: str  # the parameter's name in the unit's module
    slot: int  # its index in the flat param's slots
    at: int  # where the piece starts in the shard
    numel: int
    param: nn.Parameter  # a view of shard[at : at + numel] (its grad: of the shard grad's)


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the shard an optimizer steps: fp32 for a module loaded in bf16 or fp16
    (low-precision masters lose small updates to rounding), else the parameter's own."""
    return torch.float32 if dtype.itemsize < 4 else dtype


@dataclass
class PendingGrad:
    """A reduce-scatter in flight (one or more collectives); ``finish`` adds its result to
    the shard's fp32 grad. With hybrid sharding, ``replicate`` starts the all-reduce of
    the result across replicas as soon as the reduce-scatter is waited for (the next
    unit's post-backward), in reduce-scatter order, the same on every rank.

    The full-size input is not referenced here: the process group keeps what the
    collective needs alive until it completes (gloo reduces a copy of its own, NCCL
    stashes the input or records its stream), and waiting releases the work and, with
    it, that memory.
    """

    flat: FlatParam
    works: list[collectives.Handle]
    out: torch.Tensor  # (shard_numel,) in reduce dtype
    divide_by: float  # what the result is still to be divided by (1: the input was)
    replicated: collectives.Handle | None = None  # the replicate all-reduce in flight
    replicating: bool = False

    @property
    def waited(self) -> bool:
        """Has the reduce-scatter been waited for (its full-size input released)?"""
        return all(work.waited for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def replicate(self) -> None:
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
            self.out, flat.replicate_group, kind="replicate_all_reduce", unit=flat.unit_name,
            async_op=True,
        )  # fmt: skip

    def finish(self) -> None:
        self.replicate()
        if self.replicated is not None:
            self.replicated.wait()
        if self.divide_by != 1:
            self.out.div_(self.divide_by)
        self.flat.accumulate(self.out)
