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
it gathers its own, and puts a :class:`FreedParameter` at each of their locations: a
later read raises an error naming the unit, never reads freed memory. The unit's own
recompute (it is checkpointed) gathers them again, as any recompute does. Only where
``reshard_after_forward`` is left to the default: ``False`` keeps them to the unit's
post-backward, as before.

Only units with nested units count (a leaf unit's post-backward comes right after its
last node anyway), and only where no nested unit's modules hold their parameters (a tie
into a nested unit): the hooks step aside while a nested unit runs forward, so what its
modules save is not counted. (A module that reads the unit's parameters from inside a
nested unit without being in its module tree -- passed in as an argument -- is outside
this argument too.) The hooks wrap whatever hooks are active around the forward (the
user's ``save_on_cpu``): each tensor goes through those as well.

The planner's trace counts the same way (``planner_trace.py``), on fake buffers.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_hooks = torch._C._autograd
_local = threading.local()  # .counting: the SavedViews whose hooks are pushed, innermost last


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
        self._pair: tuple[Any, Any] | None = None  # pack/unpack, while the forward runs
        self._on_stack = False

    def start(self, buffers: list[torch.Tensor]) -> None:
        """The unit's forward starts: count what is saved of ``buffers`` from now on
        (nothing where saved-tensor hooks are disabled)."""
        if self._pair is not None or not _hooks._saved_tensors_hooks_is_enabled():
            return
        storages = {b.untyped_storage()._cdata for b in buffers}
        self._pair = _hooks_around(self, storages, _hooks._top_saved_tensors_default_hooks(True))
        self._push()
        _counting().append(self)

    def stop(self) -> None:
        """The unit's forward is over; what was saved stays counted."""
        if self._pair is None:
            return
        self._pop()
        self._pair = None
        stack = _counting()
        if self in stack:
            stack.remove(self)

    def _push(self) -> None:
        _hooks._push_saved_tensors_default_hooks(*self._pair)
        self._on_stack = True

    def _pop(self) -> bool:
        top = _hooks._top_saved_tensors_default_hooks(True)
        if not self._on_stack or top is None or top[0] is not self._pair[0]:
            return False  # not ours on top: leave the stack as it is
        _hooks._pop_saved_tensors_default_hooks()
        self._on_stack = False
        return True


def pause_enclosing() -> SavedViews | None:
    """A nested unit's forward starts: the enclosing unit's hooks step aside (returned,
    for :func:`resume`), so its modules' saved tensors cost no hook call."""
    stack = _counting()
    if stack and stack[-1]._pop():
        return stack[-1]
    return None


def resume(views: SavedViews | None) -> None:
    """The nested unit's forward is over: the paused hooks count again."""
    if views is not None and views._pair is not None and not views._on_stack:
        views._push()


def _counting() -> list[SavedViews]:
    stack = getattr(_local, "counting", None)
    if stack is None:
        stack = _local.counting = []
    return stack


def _hooks_around(
    views: SavedViews, storages: set[int], outer: tuple[Any, Any] | None
) -> tuple[Any, Any]:
    """A pack/unpack pair that counts tensors whose storage is in ``storages`` and passes
    every tensor through the ``outer`` pair (which would have packed it, had this pair not
    been pushed)."""
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(tensor: torch.Tensor) -> Any:
        inner = tensor if outer_pack is None else outer_pack(tensor)
        try:
            mine = tensor.untyped_storage()._cdata in storages
        except (RuntimeError, NotImplementedError):  # no storage (sparse): not a view
            mine = False
        return _Saved(inner, views) if mine else inner

    def unpack(packed: Any) -> torch.Tensor:
        if type(packed) is _Saved and packed.views is views:
            packed = packed.inner
        return packed if outer_unpack is None else outer_unpack(packed)

    return pack, unpack


def freed_in_backward_message(unit: str) -> str:
    """What a read of a parameter freed by ``runtime.free_unread`` says (``{op}``: the op)."""
    return (
        f"fsdp_lite: {{op}} read a parameter of {unit} after its full parameters were freed "
        "in backward, once autograd had released every tensor it saved from them (see "
        "fsdp_lite/saved_views.py). Something read them again in this backward without "
        f"saving them: torch.utils.checkpoint around modules of {unit} outside its nested "
        "units, or a custom autograd.Function keeping a parameter outside "
        f"ctx.save_for_backward. Pass reshard_after_forward=False to the FSDPModule of {unit} "
        "to keep them until its post-backward."
    )
