"""How many tensors saved for backward still read a unit's full buffers.

[Note: freeing a unit's full parameters inside its backward]
The root keeps its full parameters from forward to backward (its backward starts first)
and frees them at its post-backward. But its post-backward comes last: its gradient is
complete only after the backward of its first modules (the embedding), while its last
ones (final norm, lm_head), whose backward runs first, were the only ones to read the
weights. Kept, the root's full parameters -- a 50k-token embedding, or Llama's embedding
and lm_head -- stay beside the whole backward's activations and gathered blocks.

Every node of the backward graph that reads a parameter reads it through a tensor
autograd saved in forward (a custom ``autograd.Function`` that keeps a tensor as an
attribute of ``ctx`` instead of ``save_for_backward`` is outside this argument). So while
such a unit runs forward, a saved-tensors hook counts each saved tensor whose data lies
in one of its full buffers, and autograd drops the count as it releases them, right
after their nodes run. Once the unit's backward has started and nothing saved reads its
buffers, the next pre-backward of any unit frees them (``runtime.free_unread``), before
it gathers its own. A recompute in backward (activation checkpointing) that reads them
gathers them again, as any recompute does.

Only units with nested units count (a leaf unit's post-backward comes right after its
last node anyway). The hook wraps whatever hooks are active around the forward (the
user's ``save_on_cpu``, an enclosing unit's count): each tensor goes through those too.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_lite.flat_param import FlatParam

_hooks = torch._C._autograd


class _Saved:
    """One counted saved tensor (as the enclosing hooks packed it); uncounted when
    autograd releases it."""

    __slots__ = ("inner", "views")

    def __init__(self, inner: Any, views: SavedViews) -> None:
        self.inner = inner
        self.views = views
        views.count += 1

    def __del__(self) -> None:
        self.views.count -= 1


class SavedViews:
    """The count of one unit's saved views, and the hooks that keep it."""

    def __init__(self) -> None:
        self.count = 0  # saved tensors alive that lie in one of the full buffers
        self._pushed: Any = None  # the pack hook while counting

    def push(self, flats: list[FlatParam]) -> None:
        """Count from now on (the unit's forward starts); nothing where hooks are disabled."""
        if self._pushed is not None or not _hooks._saved_tensors_hooks_is_enabled():
            return
        ranges = [
            (ptr, ptr + flat.full_nbytes)
            for flat in flats
            if flat.is_unsharded and (ptr := flat.full_data.data_ptr())
        ]
        pack, unpack = _hooks_around(self, ranges, _hooks._top_saved_tensors_default_hooks(True))
        _hooks._push_saved_tensors_default_hooks(pack, unpack)
        self._pushed = pack

    def pop(self) -> None:
        """Stop counting (the unit's forward is over); saved views stay counted."""
        if self._pushed is None:
            return
        top = _hooks._top_saved_tensors_default_hooks(True)
        if top is not None and top[0] is self._pushed:
            _hooks._pop_saved_tensors_default_hooks()
        self._pushed = None


def _hooks_around(
    views: SavedViews, ranges: list[tuple[int, int]], outer: tuple[Any, Any] | None
) -> tuple[Any, Any]:
    """A pack/unpack pair that counts tensors in ``ranges`` and passes every tensor through
    the ``outer`` pair first (they would have packed it, had this pair not been pushed)."""
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(tensor: torch.Tensor) -> Any:
        inner = tensor if outer_pack is None else outer_pack(tensor)
        return _Saved(inner, views) if _in_ranges(tensor, ranges) else inner

    def unpack(packed: Any) -> torch.Tensor:
        if type(packed) is _Saved and packed.views is views:
            packed = packed.inner
        return packed if outer_unpack is None else outer_unpack(packed)

    return pack, unpack


def _in_ranges(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    try:
        ptr = tensor.data_ptr()
    except RuntimeError:  # no data (a fake or sparse tensor): not a view of a full buffer
        return False
    return any(lo <= ptr < hi for lo, hi in ranges)
