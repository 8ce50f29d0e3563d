"""Flat parameters: flatten, pad, shard, gather into a full buffer, point views at it.

[Note: one full buffer for the life of the unit]
Autograd saves views of the full parameters for backward. A ``FlatParam`` therefore
keeps *one* full-buffer tensor forever: resharding frees its storage with
``untyped_storage().resize_(0)`` and unsharding re-allocates the same storage and
gathers into it, so views (and tensors saved for backward) stay valid. Collectives
write through ``full_data``, a second tensor on the same storage with its own version
counter, so the in-place gather does not trip autograd's saved-tensor version check;
``full`` is the autograd leaf the module's parameter views are taken from.

Between uses each parameter location holds a ``FreedParameter`` (``freed.py``); what the
optimizer sees of the shard is in ``optim_view.py``, gradient reduction in ``reduce.py``.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_lite.core import accounting, collectives
from fsdp_lite.core.dtensors import Layout, local_tensor
from fsdp_lite.core.freed import FreedParameter, between_steps_message, freed_parameter
from fsdp_lite.core.home import DeviceHome
from fsdp_lite.core.optim_view import OrigParams, mark_shard
from fsdp_lite.core.policies import master_dtype


@dataclass
class ParamSlot:
    """One original parameter inside a flat param."""

    locations: list[tuple[nn.Module, str]]  # every (module, attribute) it was registered at
    name: str  # a readable name, for errors
    shape: torch.Size  # a DTensor's local shape
    numel: int
    offset: int  # into the unpadded flat param
    # A DTensor parameter's placements on its (non-dp) mesh; None for a plain tensor.
    layout: Layout | None = None

    @property
    def full_shape(self) -> torch.Size:
        """The parameter's shape in the unwrapped model (a DTensor's global shape)."""
        return self.shape if self.layout is None else self.layout.shape

    def as_module_sees(self, piece: torch.Tensor) -> torch.Tensor:
        """``piece`` (this slot's elements of the full buffer) as the module's parameter:
        a view of the slot's shape, rebuilt as a DTensor on its mesh where it was one."""
        view = piece.view(self.shape)
        return view if self.layout is None else self.layout.wrap(view)

    def whole_value(self, local: torch.Tensor) -> torch.Tensor:
        """The unwrapped model's value from this slot's ``local`` value (a DTensor's local
        tensor: collective over its mesh)."""
        local = local.view(self.shape)
        return local if self.layout is None else self.layout.full_value(local)

    def local_value(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of the unwrapped model's value ``whole`` (no communication)."""
        return whole if self.layout is None else self.layout.local_part(whole)


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
        fp32_masters: bool = True,
        tag: accounting.Tag,
        unit_key: int,
    ) -> None:
        self.slots = slots
        # The owning unit's tag (its name and its tree's ledger: ``name_unit``) and identity.
        self.tag = tag
        self.unit_key = unit_key
        self.group = group
        # Where gradients are reduce-scattered: ``group``, or a second group over the same
        # ranks (FSDPModule.set_separate_reduce_scatter_group).
        self.reduce_group = group
        self.world_size = collectives.world_size(group)
        self.rank = collectives.rank(group)
        # Hybrid sharding: shard grads are averaged over this group after the reduce-scatter.
        self.replicate_group = replicate_group
        self.replicas = collectives.world_size(replicate_group) if replicate_group else 1
        # How many ranks' gradients the reduction averages: the groups' ranks, or for a unit
        # over a smaller mesh than its root's (experts over dp / ep), the root's
        # (``Unit.average_grads_over``, as ``checks.mesh_divisor`` says).
        self.averaged_over = self.world_size * self.replicas
        self.compute_dtype = compute_dtype
        self.requires_grad = originals[0].requires_grad
        self.numel = sum(s.numel for s in slots)  # unpadded
        self._lay_out(owners)
        # Weak references to the original parameters, so an enclosing unit can tell
        # that a parameter it meets was already flattened here (a tie across units).
        self.original_refs = [weakref.ref(p) for p in originals]

        with torch.no_grad():
            dtype = originals[0].dtype
            shard = _build_shard(
                self, originals, sync, device, master_dtype(dtype) if fp32_masters else dtype
            )
        # The master copy: the only tensor an optimizer sees.  shape: (shard_numel,)
        self.shard = nn.Parameter(shard, requires_grad=self.requires_grad)
        mark_shard(self.shard, (self.world_size, self.replicas), compute_dtype)
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
        # Called with the full gradient once it is complete (set by ``on_grad_complete``).
        self._grad_hook: Callable[[torch.Tensor], None] | None = None
        self._hooked = False  # _grad_hook registered on ``full``
        # Did this backward's first reduced gradient find no shard grad (True: it made one)
        # or add to one (False)? None: nothing reduced since the last end of backward.
        self.grad_made: bool | None = None
        # fp32 sum of gradients kept unreduced under no_sync.  shape: (padded_numel,)
        self.unsharded_grad: torch.Tensor | None = None
        # An all-gather in flight into full_data, and its send buffer (kept alive until done).
        self._gather: collectives.Handle | None = None
        self._gather_send: torch.Tensor | None = None
        # One FreedParameter per slot, at its locations whenever full_data is freed.
        self.placeholders: list[FreedParameter] | None = None
        # (slot index, module, attribute) of every location, in one list (_install).
        self._targets = [
            (i, module, attr) for i, slot in enumerate(slots) for module, attr in slot.locations
        ]
        # This iteration's views of ``full``, one per slot (use_full_views), for backward.
        self.views: list[torch.Tensor] | None = None
        # optimizer_params 'pieces' / 'whole': what the optimizer sees instead of the shard.
        self.orig_params: OrigParams | None = None

    def name_unit(self, tag: accounting.Tag, key: int) -> None:
        """The owning unit's name and identity, for accounting and messages; placeholders
        made from now on name it."""
        if self.is_unsharded:  # a live full buffer moves to the new ledger
            self._ledger_freed()
            tag.ledger.full_allocated(id(self), key, self.full_nbytes)
        self.tag, self.unit_key = tag, key
        self.placeholders = None

    def _lay_out(self, owners: list[int] | None) -> None:
        """Rank r keeps elements ``[bounds[r], bounds[r + 1])`` of the padded flat param: a
        ``ceil(numel / W)`` slice each, or (whole params) the slots ``owners`` gives it."""
        self.whole = owners is not None  # cut on parameter boundaries
        if owners is None:
            self.bounds = even_bounds(self.numel, self.world_size)
        else:
            self.bounds = _slot_bounds(self.slots, owners, self.world_size)
        self.padded_numel = self.bounds[-1]
        self.shard_numel = self.bounds[self.rank + 1] - self.bounds[self.rank]
        # Each rank's shard size where they differ (collectives then take per-rank sizes).
        sizes = [b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False)]
        self.rank_sizes = sizes if len(set(sizes)) > 1 else None

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
            self._hook_full()
        else:
            self.full_data.untyped_storage().resize_(self.full_nbytes)

    def _hook_full(self) -> None:
        """The post-accumulate hook on ``full``, once, when it is trainable."""
        if self.requires_grad and not self._hooked and self.full is not None:
            if self._grad_hook is not None:
                self.full.register_post_accumulate_grad_hook(self._grad_hook)
                self._hooked = True

    def on_grad_complete(self, hook: Callable[[torch.Tensor], None]) -> None:
        """Call ``hook`` with the full gradient once it is complete, every backward."""
        self._grad_hook = hook
        self._hook_full()

    def set_requires_grad(self, requires_grad: bool) -> None:
        """Freeze or unfreeze after wrapping (between steps): from now on the full buffer
        needs a gradient, and the gradient is reduced, iff ``requires_grad``."""
        self.requires_grad = requires_grad
        self.shard.requires_grad_(requires_grad)
        if self.full is not None:
            self.full.requires_grad_(requires_grad)
        self._hook_full()

    def wants_grad(self) -> bool:
        """What the optimizer's parameters ask now: the shard's ``requires_grad`` (the same
        object on every rank), or with orig params, a gradient once any piece of this rank
        asks for one. Pieces differ by rank, so a piece turned off never turns the flat
        param off (the piece gets no gradient: ``OrigParams.link``), or ranks that hold
        different pieces would issue different reduce-scatters."""
        if self.orig_params is None:
            return self.shard.requires_grad
        return self.requires_grad or any(o.param.requires_grad for o in self.orig_params)

    def version(self) -> int:
        """Grows whenever the shard, or what the optimizer sees of it, is written in place
        (an optimizer step, a load): the version counters of the shard and its pieces
        (``.data`` writes bypass them)."""
        if self.orig_params is None:
            return self.shard._version
        return self.shard._version + sum(o.param._version for o in self.orig_params)

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
        self.tag.ledger.full_allocated(id(self), self.unit_key, self.full_nbytes)
        with torch.no_grad():
            send = self.home.shard_for_gather(self.shard).to(self.compute_dtype)
            self._gather = collectives.all_gather_flat(
                self.full_data, send, self.group, async_op=True, tag=self.tag,
                sizes=self.rank_sizes,
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
            self._ledger_freed()
            self.use_placeholders()

    def _ledger_freed(self) -> None:
        self.tag.ledger.full_freed(id(self), self.unit_key)

    def gather_fp32(self, source: torch.Tensor | None = None) -> torch.Tensor:
        """A new unpadded full copy of ``source`` (default: the master shard) from every rank.

        ``source`` is shard-shaped, e.g. ``shard.grad``; the result has the shard's dtype.
        """
        with torch.no_grad():
            fetched = source is None
            source = self.home.shard_for_gather(self.shard) if fetched else source.detach()
            source = source.to(self.device, self.shard.dtype)
            out = torch.empty(self.padded_numel, dtype=self.shard.dtype, device=self.device)
            collectives.all_gather_flat(
                out, source, self.group, tag=self.tag, sizes=self.rank_sizes
            )
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
            slot.as_module_sees(piece) for slot, piece in zip(self.slots, pieces, strict=False)
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
        plain tensor, without its checks. With orig params, views of the full buffer are
        also the module's registered parameters while they are installed, so the module's
        own ``named_parameters()`` inside its forward reads as unwrapped (as FSDP1's
        ``use_orig_params``); placeholders are not."""
        registered = self.orig_params is not None and not isinstance(tensors[0], FreedParameter)
        for i, module, attr in self._targets:
            params = module._parameters
            if registered:
                params[attr] = tensors[i]
            elif attr in params:
                del params[attr]
            module.__dict__[attr] = tensors[i]

    def use_placeholders(self) -> None:
        """A :class:`FreedParameter` at every original location (see Note); made once."""
        if self.placeholders is None:
            unit = self.tag.name
            self.placeholders = [
                freed_parameter(
                    slot.shape,
                    self.compute_dtype,
                    self.device,
                    between_steps_message(slot.name, unit),
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

    # -- what the optimizer sees (optim_view.py) ---------------------------------------

    def make_orig_params(self) -> OrigParams:
        """optimizer_params 'pieces' / 'whole': the optimizer sees this rank's pieces of the
        original parameters instead of the shard."""
        pieces = [
            (self.slots[i].name, i, self.slots[i].shape, hi - lo, at)
            for i, lo, hi, at in self.pieces()
        ]
        ranks = (self.world_size, self.replicas)
        self.orig_params = OrigParams(
            self.shard, pieces, ranks, self.compute_dtype, cut=not self.whole,
            originals=[ref() for ref in self.original_refs],
        )  # fmt: skip
        return self.orig_params

    def adopt_orig_writes(self) -> None:
        """Orig params: a piece whose ``.data`` was replaced (``p.data = t``) no longer views
        the shard; copy its value into the shard and view the shard again (as FSDP1's
        ``use_orig_params`` does). Called wherever the shard is read between steps."""
        if self.orig_params is not None:
            self.orig_params.adopt_writes(self.home.before_host_write)

    def optimizer_params(self) -> list[nn.Parameter]:
        """What an optimizer over this flat param steps: its orig params, else the shard."""
        return [self.shard] if self.orig_params is None else self.orig_params.params()

    def grads(self) -> list[torch.Tensor]:
        """The gradients an optimizer over this flat param would step."""
        if self.orig_params is None:
            return [] if self.shard.grad is None else [self.shard.grad]
        return self.orig_params.grads()

    def grad_as_shard(self) -> torch.Tensor | None:
        """The gradients as one shard-shaped tensor, for reading; None where there are none."""
        if self.orig_params is None:
            return self.shard.grad
        return self.orig_params.grad_as_shard()

    @property
    def has_layouts(self) -> bool:
        """Some slot is a DTensor parameter (``dtensors.py``)."""
        return any(slot.layout is not None for slot in self.slots)

    def norm_parts(self) -> list[tuple[torch.Tensor, collectives.ProcessGroup, Layout | None]]:
        """The gradients for a norm (``grads.total_norm``), each with the group that splits
        it and, with DTensor slots, cut by slot with each slot's layout (None: plain)."""
        if not self.has_layouts:
            return [(g, self.group, None) for g in self.grads()]
        grad = self.grad_as_shard()
        if grad is None:
            return []
        return [
            (grad[at : at + hi - lo], self.group, self.slots[i].layout)
            for i, lo, hi, at in self.pieces()
        ]

    def accumulate(self, grad: torch.Tensor) -> None:
        """Add a reduced shard grad (compute device, reduce dtype) to the shard's fp32 grad,
        in its home (orig params: linked again at the end of backward)."""
        if self.orig_params is not None and self.shard.grad is None:
            self.shard.grad = self.orig_params.fold()
        if self.grad_made is None:
            self.grad_made = self.shard.grad is None
        self.home.accumulate_grad(self.shard, grad)

    def link_orig_grads(self) -> None:
        """End of backward (its home settled): the optimizer's parameters see the shard
        grad."""
        self.grad_made = None
        if self.orig_params is not None:
            self.orig_params.link()

    def drop_partial_grad(self) -> bool:
        """An interrupted backward (its home settled): drop the shard grad it made. True if
        it added to a grad of earlier backwards instead, which keeps what it added."""
        made = self.grad_made
        if made:
            self.shard.grad = None
        self.link_orig_grads()
        return made is False

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


def _build_shard(
    flat: FlatParam,
    originals: list[nn.Parameter],
    sync: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """This rank's slice of the padded flat param, in ``dtype``. Without ``sync`` it is
    copied straight from the originals, so no full-size flat buffer is ever allocated."""
    start, end = flat.rank_range()
    if sync:  # sync_module_states: every rank starts from rank 0's values
        full = torch.zeros(flat.padded_numel, dtype=dtype, device=device)
        for slot, p in zip(flat.slots, originals, strict=True):
            full[slot.offset : slot.offset + slot.numel].copy_(local_tensor(p).reshape(-1))
        collectives.broadcast_from_first(full, [flat.replicate_group, flat.group], flat.tag)
        return full[start:end].clone()
    shard = torch.zeros(flat.shard_numel, dtype=dtype, device=device)
    for slot, p in zip(flat.slots, originals, strict=True):
        lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
        if lo < hi:
            piece = local_tensor(p).reshape(-1)[lo - slot.offset : hi - slot.offset]
            shard[lo - start : hi - start].copy_(piece)
    return shard


def even_bounds(numel: int, world_size: int) -> list[int]:
    """Rank r keeps [r * s, (r + 1) * s) of the flat param padded to W * s, s = ceil(numel / W)."""
    per = -(-numel // world_size)
    return [r * per for r in range(world_size + 1)]


def _slot_bounds(slots: list[ParamSlot], owners: list[int], world_size: int) -> list[int]:
    """Whole params: rank r keeps the slots ``owners`` gives it, laid out consecutively in
    rank order (``slots`` is sorted by owner); no padding."""
    if owners != sorted(owners):
        raise ValueError("whole params: slots must be laid out in owner order")
    bounds = [0] * (world_size + 1)
    for slot, owner in zip(slots, owners, strict=True):
        bounds[owner + 1] = slot.offset + slot.numel
    for r in range(1, world_size + 1):
        bounds[r] = max(bounds[r], bounds[r - 1])
    return bounds
