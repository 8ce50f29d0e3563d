"""OffloadModel: train an ``nn.Sequential`` larger than device memory, one slice at a time.

[Note: one autograd Function per slice]
``_SliceFunction`` takes a slice's input and its master parameters (on ``offload_device``)
and runs the layers on *device copies* of them (``torch.func.functional_call``). Its
backward gets the copies' grads from ``torch.autograd.grad`` and returns them, moved to
``offload_device``, as the masters' grads: AccumulateGrad adds them to ``master.grad``
as for a plain module, and the copies never get a ``.grad``. A slice is loaded only
inside its Function's forward and backward, so one slice at a time is resident.

[Note: backward in each mode]
``checkpoint_activation=True``: forward runs a slice under ``torch.no_grad()`` and keeps
its input (on ``offload_device``) and the RNG state before each microbatch; backward
reloads the slice, recomputes each microbatch with grad from its RNG state, backpropagates
it, and drops the slice. ``checkpoint_activation=False``: forward keeps each microbatch's
graph (activations stay on ``device``) and frees the parameter copies' storage
(``untyped_storage().resize_(0)``); backward refills it from the masters, so the views
the graph saved read valid data again, and backpropagates without recomputing. Both
modes run the same kernels in the same order: their results are bitwise equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.autograd.profiler import record_function
from torch.func import functional_call

from fsdp_lite.addons.offload_slices import (
    KeptGraph,
    Resident,
    Slice,
    check_config,
    partition,
    pinned,
    rng_restored,
)
from fsdp_lite.core import devices

_CPU = torch.device("cpu")
_Grads = tuple[torch.Tensor | None, dict[int, torch.Tensor]]  # (input, id(master) -> param)


class OffloadModel(nn.Module):
    """Keep ``model`` on ``offload_device`` and run it on ``device`` one slice at a time.

    The layers are cut into ``num_slices`` contiguous slices of roughly equal parameter
    count (``slices`` names them). Parameters and buffers live on ``offload_device``
    (pinned when ``device`` is CUDA); an optimizer over ``parameters()`` steps them
    there, and their grads land there and accumulate across backward calls as a normal
    module's do. Each slice is copied to ``device`` for its forward and again for its
    backward, then dropped. Inputs may live anywhere; the output is on ``device``. There
    is no ``.to(device)``: moving the wrapper raises (dtype casts are fine).

    Every layer must take one tensor and return one tensor; a first forward that finds
    otherwise raises ``TypeError`` with buffers and RNG state restored. ``state_dict()``
    keys and parameter names equal ``model``'s.

    Args:
        model: the ``nn.Sequential`` to wrap; its layers are moved to ``offload_device``
            and registered under their own names, not copied.
        device: where slices compute.
        offload_device: where parameters, buffers and gradients live.
        num_slices: how many slices to cut the layers into, 1 to ``len(model)``.
        checkpoint_activation: recompute each slice in backward, keeping only slice
            inputs (on ``offload_device``); otherwise activations stay on ``device`` and
            backward reloads only parameters. See [Note: backward in each mode].
        num_microbatches: split every input along dim 0 into this many equal chunks and
            run each slice over all of them before the next. Allowed in both modes, so
            results do not depend on ``checkpoint_activation``; it saves memory only with
            checkpointing. Layers see chunks: BatchNorm normalizes per chunk and updates
            its running statistics once per chunk; dropout draws masks per chunk, in
            slice-then-chunk order (the recompute replays them exactly).

    Without checkpointing, one backward per forward (``retain_graph`` needs checkpointing);
    no double backward. The recompute reads buffers as forward left them: right for
    BatchNorm (training uses batch statistics), not for a layer whose training output
    depends on a buffer it updates.
    """

    def __init__(
        self,
        model: nn.Sequential,
        device: torch.device | str,
        offload_device: torch.device | str = _CPU,
        num_slices: int = 3,
        checkpoint_activation: bool = False,
        num_microbatches: int = 1,
    ) -> None:
        check_config(model, num_slices, num_microbatches)
        super().__init__()
        self.device = devices.resolve(device)
        self.offload_device = devices.resolve(offload_device)
        self.checkpoint_activation = checkpoint_activation
        self.num_microbatches = num_microbatches
        # Pinned host memory and non_blocking copies pay off between CPU and CUDA only.
        self._pinned = devices.pins_host_memory(self.device) and self.offload_device.type == "cpu"
        self._resident: set[int] = set()  # slices whose device copies exist (at most one)
        self._checked = False  # until a forward succeeds, failures restore buffers and RNG
        for name, layer in model._modules.items():
            if hasattr(self, name) and name not in self._modules:
                raise ValueError(f"layer name {name!r} clashes with an OffloadModel attribute")
            self.add_module(name, layer)
        model.to(self.offload_device)
        names, layers = list(model._modules), list(model._modules.values())
        bounds = partition([sum(p.numel() for p in m.parameters()) for m in layers], num_slices)
        self._slices = [
            Slice(i, tuple(names[a:b]), tuple(layers[a:b]))
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
        ]
        if self._pinned:  # parameters keep their identity (Module._apply sets .data)
            super()._apply(pinned)

    @property
    def slices(self) -> tuple[tuple[str, ...], ...]:
        """The layer names of each slice, in order."""
        return tuple(s.names for s in self._slices)

    @property
    def resident_slices(self) -> tuple[int, ...]:
        """Indices of the slices copied to ``device`` right now (never more than one)."""
        return tuple(sorted(self._resident))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        with contextlib.nullcontext() if self._checked else self._restored_on_error():
            for s in self._slices:
                params = s.params()
                graph = x.requires_grad or any(p.requires_grad for p in params)
                if torch.is_grad_enabled() and graph:
                    x = _SliceFunction.apply(self, s.index, x, *params)
                else:
                    x, _ = self._run_slice(s, x, self.device)
            if self._pinned:  # the host may write the masters as soon as we return
                devices.synchronize(self.device)
        self._checked = True
        return x

    def _load_slice(self, s: Slice, *, grad: bool) -> Resident:
        """Copy slice ``s``'s parameters (requiring grad if ``grad``) and buffers to device."""
        self._mark_resident(s.index)
        r = Resident(s.index, {}, {}, [], {})
        with record_function(f"OffloadModel::load_slice{s.index}"):
            for layer in s.layers:
                tensors = {}
                for name, t in [
                    *layer.named_parameters(remove_duplicate=False),
                    *layer.named_buffers(remove_duplicate=False),
                ]:
                    table = r.params if isinstance(t, nn.Parameter) else r.buffers
                    if id(t) not in table:
                        copy = self._copy(t, self.device)
                        table[id(t)] = (t, copy.requires_grad_(grad and t.requires_grad))
                    tensors[name] = table[id(t)][1]
                r.per_layer.append(tensors)
        return r

    def _drop_slice(self, r: Resident, *, write_back: bool, free: bool = False) -> None:
        """Forget slice ``r``'s copies: ``write_back`` copies buffers home first; ``free``
        releases the parameter copies' storage but keeps the tensors (and the views
        autograd saved of them) for ``_refill_slice``."""
        with record_function(f"OffloadModel::drop_slice{r.index}"), torch.no_grad():
            for master, copy in r.buffers.values() if write_back else ():
                master.copy_(copy)  # blocking: the host may read it right away
            for key, (_, copy) in r.params.items() if free else ():
                r.nbytes[key] = copy.untyped_storage().nbytes()
                copy.untyped_storage().resize_(0)
        self._resident.discard(r.index)

    def _refill_slice(self, r: Resident) -> None:
        """Re-allocate the freed parameter copies and copy the masters into them."""
        self._mark_resident(r.index)
        with record_function(f"OffloadModel::load_slice{r.index}"), torch.no_grad():
            for key, (master, copy) in r.params.items():
                copy.untyped_storage().resize_(r.nbytes[key])
                # Through .data: the refill must not bump the version autograd checks.
                copy.data.copy_(master.detach(), non_blocking=self._pinned)

    def _mark_resident(self, index: int) -> None:
        if self._resident:  # the one-slice invariant; a bug if it ever fires
            raise RuntimeError(f"OffloadModel: loading slice {index} while {self._resident} is")
        self._resident.add(index)

    def _run_slice(
        self,
        s: Slice,
        x: torch.Tensor,
        home: torch.device,
        *,
        rng: list[devices.RngState] | None = None,
        keep: bool = False,
        input_grad: bool = False,
    ) -> tuple[torch.Tensor, KeptGraph | None]:
        """Run slice ``s`` over the chunks of ``x``, output on ``home``. With ``rng``,
        append the RNG state before each chunk to it. With ``keep``, run with autograd
        and return each chunk's graph for backward, the parameter copies' storage freed."""
        r = self._load_slice(s, grad=keep)
        kept = KeptGraph(r, [], []) if keep else None

        def outputs() -> Iterator[torch.Tensor]:
            for chunk in self._chunks(x):
                if rng is not None:
                    rng.append(devices.rng_state(self.device))
                leaf, h = self._enter(chunk, input_grad)
                out = self._call_layers(s, r, h)
                if kept is not None:
                    kept.leaves.append(leaf)
                    kept.outputs.append(out)
                yield out.detach()

        ok = False
        try:
            with torch.set_grad_enabled(keep):
                out = self._assemble(outputs(), home)
            ok = True
        finally:
            self._drop_slice(r, write_back=ok, free=keep)
        return out, kept

    def _call_layers(self, s: Slice, r: Resident, h: torch.Tensor) -> torch.Tensor:
        for name, layer, tensors in zip(s.names, s.layers, r.per_layer, strict=True):
            h = functional_call(layer, tensors, (h,))
            if not isinstance(h, torch.Tensor):
                raise TypeError(
                    f"OffloadModel: layer {name!r} ({type(layer).__name__}) returned "
                    f"{type(h).__name__}; every layer must take and return a single tensor"
                )
        return h

    def _enter(self, chunk: torch.Tensor, grad: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A fresh device copy of ``chunk`` for the first layer and, with ``grad``, the
        leaf to take the chunk's gradient at. The layer gets a clone of the leaf, so it
        may modify its input in place as it may in the plain model."""
        h = self._copy(chunk, self.device)
        return (h.requires_grad_(), h.clone()) if grad else (None, h)

    def _backward_slice(self, ctx: Any, grad_out: torch.Tensor) -> _Grads:
        """Gradients of a slice's input and master parameters (see [Note: backward in
        each mode])."""
        s = self._slices[ctx.index]
        grads = (self._copy(g, self.device, only_if_moving=True) for g in self._chunks(grad_out))
        if ctx.checkpoint:
            (saved,) = ctx.saved_tensors
            r = self._load_slice(s, grad=True)
            per_chunk = self._recompute(s, r, saved, ctx, grads)
        else:
            if ctx.kept is None:
                raise RuntimeError("OffloadModel: use checkpoint_activation=True to backward twice")
            (r, leaves, outs), ctx.kept = ctx.kept, None
            self._refill_slice(r)
            per_chunk = map(self._chunk_grads, outs, leaves, grads, [r] * len(outs))
        try:
            with record_function(f"OffloadModel::backward_slice{s.index}"):
                return self._sum_grads(per_chunk, r, ctx.x_device)
        finally:
            self._drop_slice(r, write_back=False, free=not ctx.checkpoint)

    def _recompute(
        self, s: Slice, r: Resident, saved: torch.Tensor, ctx: Any, grads: Iterable
    ) -> Iterator[_Grads]:
        """Per chunk: recompute it with grad from its saved RNG state and backpropagate."""
        for chunk, state, grad in zip(self._chunks(saved), ctx.rng, grads, strict=True):
            with rng_restored(state, self.device), torch.enable_grad():
                leaf, h = self._enter(chunk, ctx.input_grad)
                out = self._call_layers(s, r, h)
            yield self._chunk_grads(out, leaf, grad, r)

    @staticmethod
    def _chunk_grads(
        out: torch.Tensor, leaf: torch.Tensor | None, grad: torch.Tensor, r: Resident
    ) -> _Grads:
        """One chunk's gradients: its input's, and each parameter copy's that got one."""
        keys = [k for k, (_, copy) in r.params.items() if copy.requires_grad]
        inputs = ([leaf] if leaf is not None else []) + [r.params[k][1] for k in keys]
        if not out.requires_grad or not inputs:
            return None, {}
        got = list(torch.autograd.grad(out, inputs, grad, allow_unused=True))
        g_leaf = got.pop(0) if leaf is not None else None
        return g_leaf, {k: g for k, g in zip(keys, got, strict=True) if g is not None}

    def _sum_grads(self, per_chunk: Iterable[_Grads], r: Resident, x_dev: torch.device) -> _Grads:
        """Sum the chunks' parameter grads (chunk 0 first), gather their input grads, and
        move both to where the input and the masters live."""
        totals: dict[int, torch.Tensor] = {}
        input_grads = []
        for g_leaf, g_params in per_chunk:
            input_grads.append(g_leaf)
            for k, g in g_params.items():
                totals[k] = totals[k] + g if k in totals else g
        has_x = all(g is not None for g in input_grads)
        grad_x = self._assemble(iter(input_grads), x_dev) if has_x else None
        moved = {
            k: self._copy(g, r.params[k][0].device, only_if_moving=True) for k, g in totals.items()
        }
        if self._pinned:  # AccumulateGrad reads the host copies as soon as we return
            devices.synchronize(self.device)
        return grad_x, moved

    def _chunks(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = self.num_microbatches
        return (x,) if m == 1 else x.split(x.shape[0] // m)

    def _assemble(self, chunks: Iterator[torch.Tensor], home: torch.device) -> torch.Tensor:
        """Concatenate chunk outputs along dim 0 on ``home``, copying each as it arrives
        (so that one chunk's output at a time is on the device)."""
        m, out = self.num_microbatches, None
        if m == 1:
            return self._copy(next(chunks), home, only_if_moving=True)
        for i, c in enumerate(chunks):
            if out is None and c.dim() > 0:
                shape, pin = (m * c.shape[0], *c.shape[1:]), self._pinned and home.type == "cpu"
                out = torch.empty(shape, dtype=c.dtype, device=home, pin_memory=pin)
            if out is None or c.shape != out[: len(out) // m].shape:
                raise ValueError(f"microbatch outputs lack a batch dim or differ: {c.shape}")
            n = len(out) // m
            out[i * n : (i + 1) * n].copy_(c, non_blocking=self._pinned)
        return out

    def _copy(
        self, t: torch.Tensor, device: torch.device, *, only_if_moving: bool = False
    ) -> torch.Tensor:
        """``t``'s data on ``device``, detached: a fresh copy unless ``only_if_moving`` and
        it is there already. Host copies go to pinned memory when that pays."""
        t = t.detach()
        if t.device == device:
            return t if only_if_moving else t.clone()
        if self._pinned and device.type == "cpu":
            return torch.empty_like(t, device=device, pin_memory=True).copy_(t, non_blocking=True)
        return t.to(device, non_blocking=self._pinned, copy=True)

    def _check_input(self, x: object) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"OffloadModel takes a single tensor, got {type(x).__name__}")
        m = self.num_microbatches
        if m > 1 and (x.dim() == 0 or x.shape[0] == 0 or x.shape[0] % m):
            batch = "a 0-d tensor" if x.dim() == 0 else f"a batch of {x.shape[0]}"
            raise ValueError(f"{batch} does not split into num_microbatches={m} equal chunks")

    @contextlib.contextmanager
    def _restored_on_error(self) -> Iterator[None]:
        """Put buffers and RNG state back if the body raises."""
        buffers, rng = [(b, b.clone()) for b in self.buffers()], devices.rng_state(self.device)
        try:
            yield
        except BaseException:
            if self._pinned:  # non-blocking copies may still read the pinned masters
                devices.synchronize(self.device)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            devices.set_rng_state(rng, self.device)
            raise

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> OffloadModel:
        to = fn(torch.zeros(1, device=self.offload_device)).device
        if to != self.offload_device:
            raise RuntimeError(f"OffloadModel lives on offload_device={self.offload_device}")
        super()._apply(fn, recurse)
        return super()._apply(pinned) if self._pinned else self


class _SliceFunction(torch.autograd.Function):
    """One slice as one autograd node (see [Note: one autograd Function per slice])."""

    @staticmethod
    def forward(
        ctx: Any, owner: OffloadModel, index: int, x: torch.Tensor, *params: Any
    ) -> torch.Tensor:
        ctx.owner, ctx.index, ctx.x_device = owner, index, x.device
        ctx.checkpoint = owner.checkpoint_activation  # the mode this forward ran in
        ctx.input_grad = ctx.needs_input_grad[2]
        s = owner._slices[index]
        if not ctx.checkpoint:
            out, ctx.kept = owner._run_slice(
                s, x, owner.device, keep=True, input_grad=ctx.input_grad
            )
            return out
        saved = owner._copy(x, owner.offload_device, only_if_moving=True)
        home = owner.device if index == len(owner._slices) - 1 else owner.offload_device
        ctx.rng = []  # the RNG state before each chunk
        out, _ = owner._run_slice(s, saved, home, rng=ctx.rng)
        ctx.save_for_backward(x if saved.device == x.device else saved)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        owner = ctx.owner
        grad_x, grads = owner._backward_slice(ctx, grad_out)
        return (None, None, grad_x, *(grads.get(id(p)) for p in owner._slices[ctx.index].params()))
