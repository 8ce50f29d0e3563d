"""Flat parameters: flatten, pad, shard, gather into a full buffer, point views at it.

[Note: one full buffer for the life of the unit]
Autograd saves views of the full parameters for backward. A ``FlatParam`` therefore
keeps *one* full-buffer tensor forever: resharding frees its storage with
``untyped_storage().resize_(0)`` and unsharding re-allocates the same storage and
gathers into it, so views (and tensors saved for backward) stay valid. Collectives
write through ``full_data``, a second tensor on the same storage with its own version
counter, so the in-place gather does not trip autograd's saved-tensor version check;
``full`` is the autograd leaf the module's parameter views are taken from.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_lite import accounting, collectives
from fsdp_lite.offload import DeviceHome


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
        sync: bool = False,
    ) -> None:
        self.slots = slots
        self.group = group
        self.world_size = collectives.world_size(group)
        self.rank = collectives.rank(group)
        self.compute_dtype = compute_dtype
        self.requires_grad = originals[0].requires_grad
        self.numel = sum(s.numel for s in slots)  # unpadded
        self.shard_numel = -(-self.numel // self.world_size)  # ceil(numel / W)
        self.padded_numel = self.shard_numel * self.world_size
        # Weak references to the original parameters, so an enclosing unit can tell
        # that a parameter it meets was already flattened here (a tie across units).
        self.original_refs = [weakref.ref(p) for p in originals]

        dtype = originals[0].dtype
        with torch.no_grad():
            flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
            for slot, p in zip(slots, originals, strict=True):
                flat[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
            if sync:  # sync_module_states: every rank starts from rank 0's values
                collectives.broadcast(flat, group)
            start = self.rank * self.shard_numel
            shard = flat[start : start + self.shard_numel].clone()
        # The master copy: the only tensor an optimizer sees.  shape: (shard_numel,)
        self.shard = nn.Parameter(shard, requires_grad=self.requires_grad)
        # Where the shard and its grad live between uses (device, CPU or files).
        self.home = home
        self.device = device  # the compute device
        home.place(self)
        # Where collectives write the gathered params.  shape: (padded_numel,), storage
        # resized to 0 while resharded.
        self.full_data = torch.empty(self.padded_numel, dtype=compute_dtype, device=device)
        self.full_data.untyped_storage().resize_(0)
        # The autograd leaf the module's views hang off; same storage as full_data.
        self.full = torch.empty(0, dtype=compute_dtype, device=device)
        self.full.data = self.full_data
        self.full.requires_grad_(self.requires_grad)
        # fp32 sum of gradients kept unreduced under no_sync.  shape: (padded_numel,)
        self.unsharded_grad: torch.Tensor | None = None
        # An all-gather in flight into full_data, and its send buffer (kept alive until done).
        self._gather: collectives.Handle | None = None
        self._gather_send: torch.Tensor | None = None
        # Accounting: the owning unit's name (set at lazy init) and identity.
        self.unit_name: str | None = None
        self.unit_key = 0

    # -- storage -----------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return self.full_data.untyped_storage().size() > 0

    @property
    def full_nbytes(self) -> int:
        return self.padded_numel * self.full_data.element_size()

    def unshard(self, async_op: bool = False) -> None:
        """Cast the shard to the compute dtype and all-gather it into the full buffer.

        With ``async_op`` the gather is only issued (a prefetch); :meth:`wait_unshard`
        completes it. A no-op when the full buffer is already allocated or in flight.
        """
        if self.is_unsharded:
            if not async_op:
                self.wait_unshard()
            return
        self.full_data.untyped_storage().resize_(self.full_nbytes)
        accounting.full_allocated(id(self), self.unit_key, self.full_nbytes)
        with torch.no_grad():
            send = self.home.shard_for_gather(self).to(self.compute_dtype)
            self._gather = collectives.all_gather_flat(
                self.full_data, send, self.group, async_op=True, unit=self.unit_name
            )
        self._gather_send = send
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self._gather is not None:
            self._gather.wait()
            self._gather = self._gather_send = None
            self.home.after_gather(self)

    def reshard(self) -> None:
        """Free the full buffer's storage (views stay valid objects, pointing at nothing)."""
        if self.is_unsharded:
            self.wait_unshard()  # never free memory a collective is still writing
            self.full_data.untyped_storage().resize_(0)
            accounting.full_freed(id(self), self.unit_key)

    def gather_fp32(self, source: torch.Tensor | None = None) -> torch.Tensor:
        """A new unpadded full copy of ``source`` (default: the master shard) from every rank.

        ``source`` is shard-shaped, e.g. ``shard.grad``; the result has the shard's dtype.
        """
        with torch.no_grad():
            fetched = source is None
            source = self.home.shard_for_gather(self) if fetched else source.detach()
            source = source.to(self.device, self.shard.dtype)
            out = torch.empty(self.padded_numel, dtype=self.shard.dtype, device=self.device)
            collectives.all_gather_flat(out, source, self.group)
            if fetched:
                self.home.after_gather(self)
        return out[: self.numel]

    def use_full_views(self) -> None:
        """Point every original parameter location at its view of the full buffer."""
        for slot in self.slots:
            view = self.full[slot.offset : slot.offset + slot.numel].view(slot.shape)
            for module, attr in slot.locations:
                setattr(module, attr, view)

    def load_full(self, flat: torch.Tensor) -> None:
        """Overwrite this rank's shard from an unpadded full flat tensor (no communication)."""
        start = self.rank * self.shard_numel
        piece = flat[start : min(start + self.shard_numel, self.numel)]
        with torch.no_grad():
            self.shard.zero_()
            self.shard[: piece.numel()].copy_(piece)

    # -- gradients ---------------------------------------------------------------

    def take_grad(self) -> torch.Tensor | None:
        """Detach the full gradient from ``full`` (plus any no_sync accumulation), fp32-or-low."""
        grad, self.full.grad = self.full.grad, None
        if self.unsharded_grad is not None:
            acc, self.unsharded_grad = self.unsharded_grad, None
            grad = acc if grad is None else acc.add_(grad)
        return grad

    def accumulate_unsharded(self) -> None:
        """no_sync: fold this backward's full gradient into an fp32 accumulator."""
        grad = self.take_grad()
        if grad is not None:
            self.unsharded_grad = grad.to(self.shard.dtype)

    def reduce_scatter_grad(self, reduce_dtype: torch.Tensor) -> PendingGrad | None:
        """Start the averaging reduce-scatter of this backward's gradient."""
        grad = self.take_grad()
        if grad is None:
            return None
        with torch.no_grad():
            # Pre-divide by W so low-precision sums cannot overflow.
            grad = grad.to(reduce_dtype)
            grad.div_(self.world_size)
            out = torch.empty(self.shard_numel, dtype=reduce_dtype, device=grad.device)
            work = collectives.reduce_scatter_flat(out, grad, self.group, unit=self.unit_name)
        return PendingGrad(self, work, out, grad)


@dataclass
class PendingGrad:
    """A reduce-scatter in flight; ``finish`` adds its result to the shard's fp32 grad."""

    flat: FlatParam
    work: collectives.Handle
    out: torch.Tensor  # (shard_numel,) in reduce dtype
    send: torch.Tensor  # the input, kept alive until the collective completes

    def finish(self) -> None:
        self.work.wait()
        self.flat.home.accumulate_grad(self.flat, self.out)
