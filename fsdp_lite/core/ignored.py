"""Ignored modules and parameters (FSDP1's ``ignored_modules``, FSDP2's ``ignored_params``):
left unsharded, whole on every rank, their gradients averaged by the root.

[Note: ignored parameters]
At wrap time the outermost unit checks what it was given (``resolve``: inside the model,
not on the meta device, not tied to a parameter that would be sharded) and then
(``take``) marks each ignored module (``tree.IGNORED_FLAG``: no policy wraps it, no unit's
region reaches into it, so its buffers keep their dtype) and each ignored parameter
(``optim_view.mark_replicated``: no unit flattens it, and the optimizer and input checks
know that something averages it), and moves them to the compute device, keeping every
``nn.Parameter`` object. They stay registered on their modules: ``parameters()`` and
``state_dict()`` hold them as in the unwrapped model.

A trainable ignored parameter is a replica on every rank, so its gradient must be
averaged across the data-parallel ranks or the replicas drift apart. The root
(``Replicas``, made with it) averages the gradients of the ignored parameters in its tree
at the end of every backward that syncs (``Root.finish_backward``; not inside
``no_sync``: the next syncing backward averages the sum, right since averaging is linear
and leaves an average as it is), over the shard group and then the replicate group: one
asynchronous all-reduce per (device, dtype) bucket, issued before the reduce-scatters are
waited for and waited after them. A backward that reaches ignored parameters but no unit
(a loss through an ignored head called outside forward) queues the same averaging from
the parameters' post-accumulate hooks. Parameters of a ``DistributedDataParallel`` module
are left to it. At the root's first forward one small all-reduce checks that the replicas
start equal (``sync_module_states=True`` broadcasts rank 0's at wrap time).
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_lite.core import collectives
from fsdp_lite.core.accounting import Tag
from fsdp_lite.core.optim_view import mark_replicated, replicated_ranks
from fsdp_lite.core.tree import IGNORED_FLAG, is_sharded

KIND = "ignored_all_reduce"  # what accounting counts the averaging under


@dataclass(frozen=True)
class Ignored:
    """What ``ignored_modules`` / ``ignored_params`` name, checked against the model."""

    modules: tuple[nn.Module, ...]
    params: tuple[nn.Parameter, ...]  # every ignored parameter, once, in module order

    def param_ids(self) -> frozenset[int]:
        return frozenset(id(p) for p in self.params)


def resolve(
    model: nn.Module,
    modules: Iterable[nn.Module] | None,
    params: Iterable[nn.Parameter] | None,
) -> Ignored | None:
    """Check what the user asked to leave unsharded (changing nothing); None if nothing."""
    modules = _as_list(modules, nn.Module, "ignored_modules", "nn.Module objects")
    params = _as_list(params, nn.Parameter, "ignored_params", "nn.Parameter objects")
    if not modules and not params:
        return None
    if not isinstance(model, nn.Module):
        raise TypeError(f"FSDPModule wraps an nn.Module, got {type(model).__name__}")
    paths: dict[int, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), name)
    for m in modules:
        if m is model:
            raise ValueError(
                f"ignored_modules holds the module being wrapped ({type(model).__name__}) "
                "itself: nothing would be sharded. Do not wrap it, or name its submodules"
            )
        if id(m) not in paths:
            raise ValueError(
                f"ignored_modules: a {type(m).__name__} that is not a submodule of the wrapped "
                f"{type(model).__name__}; pass modules from inside the model (e.g. model.head)"
            )
        if any(is_sharded(sub) for sub in m.modules()):
            raise ValueError(
                f"ignored module '{paths[id(m)]}' ({type(m).__name__}) is, or holds, a module "
                "an FSDPModule already sharded: it cannot also be left unsharded. Unwrap it, "
                "or ignore only the submodules no FSDPModule wraps"
            )
    inside, outside, found = _locations(model, {id(m) for m in modules})
    explicit = {id(p) for p in params}
    for p in params:
        if id(p) not in found:
            raise ValueError(
                f"ignored_params: a parameter of shape {tuple(p.shape)} is not a parameter "
                f"of the wrapped {type(model).__name__} (or was already sharded)"
            )
    for pid, where in inside.items():
        if pid in outside and pid not in explicit:
            raise ValueError(
                f"parameter '{where[0]}' of an ignored module is tied to '{outside[pid][0]}', "
                "which fsdp_lite would shard: a parameter is either sharded or left whole. "
                "Ignore the modules of every use, untie them, or name the parameter in "
                "ignored_params (it is then left whole at every use)"
            )
    chosen = [p for pid, p in found.items() if pid in inside or pid in explicit]
    _refuse_meta(modules, chosen, paths, {**outside, **inside})
    return Ignored(tuple(modules), tuple(chosen))


def _as_list(items: object, kind: type, arg: str, what: str) -> list:
    if items is None:
        return []
    if isinstance(items, nn.Module | torch.Tensor) or not isinstance(items, Iterable):
        raise TypeError(f"{arg} takes an iterable of {what}, got {type(items).__name__}")
    out = list(items)
    bad = [type(x).__name__ for x in out if not isinstance(x, kind)]
    if bad:
        raise TypeError(f"{arg} takes {what}, got {bad[0]}")
    return list({id(x): x for x in out}.values())


def _locations(
    model: nn.Module, ignored: set[int]
) -> tuple[dict[int, list[str]], dict[int, list[str]], dict[int, nn.Parameter]]:
    """Every path each parameter is registered under, inside an ignored module's subtree
    and outside one; and the parameters by id, in module order."""
    inside: dict[int, list[str]] = {}
    outside: dict[int, list[str]] = {}
    found: dict[int, nn.Parameter] = {}

    def visit(m: nn.Module, path: str, under: bool) -> None:
        under = under or id(m) in ignored
        for attr, p in m._parameters.items():
            if p is not None:
                (inside if under else outside).setdefault(id(p), []).append(path + attr)
                found.setdefault(id(p), p)
        for name, child in m._modules.items():
            if child is not None:
                visit(child, f"{path}{name}.", under)

    visit(model, "", False)
    return inside, outside, found


def _refuse_meta(
    modules: list[nn.Module],
    params: list[nn.Parameter],
    paths: dict[int, str],
    where: dict[int, list[str]],
) -> None:
    for m in modules:
        for sub in m.modules():
            tensors = [*sub._parameters.values(), *sub._buffers.values()]
            if any(t is not None and t.is_meta for t in tensors):
                raise RuntimeError(
                    f"fsdp_lite: ignored module '{paths[id(m)]}' ({type(m).__name__}) is on "
                    "the meta device: fsdp_lite leaves ignored modules as they are and does "
                    "not initialize them. Materialize it before wrapping (e.g. "
                    "module.to_empty(device=...) and its reset_parameters(), or load its "
                    "weights)"
                )
    for p in params:
        if p.is_meta:
            raise RuntimeError(
                f"fsdp_lite: ignored parameter '{where[id(p)][0]}' is on the meta device: "
                "materialize it before wrapping"
            )


def take(
    ignored: Ignored,
    device: torch.device,
    process_group: collectives.ProcessGroup,
    replicate_group: collectives.ProcessGroup | None,
    sync: bool,
    tag: Tag,
) -> None:
    """Leave ``ignored`` unsharded in the outermost unit's tree: mark the modules and the
    parameters, move them (and the modules' buffers) to ``device`` keeping every object,
    and with ``sync`` (``sync_module_states``) broadcast rank 0's values."""
    ranks = (
        collectives.world_size(process_group),
        collectives.world_size(replicate_group) if replicate_group is not None else 1,
    )
    for m in ignored.modules:
        m.__dict__[IGNORED_FLAG] = True
    tensors: list[torch.Tensor] = []
    with torch.no_grad():
        for p in ignored.params:
            mark_replicated(p, ranks)
            if p.device != device:
                p.data = p.data.to(device)
                if p.grad is not None:
                    p.grad = p.grad.to(device)
            tensors.append(p.detach())
        for sub in {id(s): s for m in ignored.modules for s in m.modules()}.values():
            for name, buf in sub._buffers.items():
                if buf is not None:
                    sub._buffers[name] = buf = buf.to(device)
                    tensors.append(buf)
        if sync:
            for t in tensors:
                collectives.broadcast_from_first(t, [replicate_group, process_group], tag)


def find(module: nn.Module) -> list[nn.Parameter]:
    """The ignored parameters registered in ``module``'s tree, once each, in module order."""
    return [p for p in module.parameters() if replicated_ranks(p) is not None]


class Replicas:
    """A root's ignored parameters: found in its tree when the root is made; the gradients
    of those it averages (not a ``DistributedDataParallel`` module's) averaged at the end
    of each syncing backward (see Note)."""

    def __init__(
        self,
        module: nn.Module,
        process_group: collectives.ProcessGroup,
        replicate_group: collectives.ProcessGroup | None,
        root: Tag,
    ) -> None:
        self.params = find(module)  # all of them (what clip_grad_norm_ counts)
        ddp = {
            id(p)
            for m in module.modules()
            if isinstance(m, nn.parallel.DistributedDataParallel)
            for p in m.parameters()
        }
        self.averaged = [p for p in self.params if id(p) not in ddp]
        self.groups = [g for g in (process_group, replicate_group) if g is not None]
        self.ranks = math.prod(collectives.world_size(g) for g in self.groups)
        # Their averaging's tag: named for the divergence check, counted in the root's ledger.
        self.tag = Tag(f"{root.name} (ignored parameters)", root.ledger)
        self.hooks: list = []

    def grads(self) -> list[torch.Tensor]:
        """The gradients of every ignored parameter (equal on every rank once averaged)."""
        return [p.grad for p in self.params if p.grad is not None]

    def watch(self, arrived: Callable[[], None]) -> None:
        """Call ``arrived()`` whenever a gradient of a trainable averaged parameter was
        accumulated (the root queues the averaging where no unit's backward did)."""
        if self.ranks == 1:
            return
        for p in self.averaged:
            if p.requires_grad:
                self.hooks.append(
                    p.register_post_accumulate_grad_hook(functools.partial(_arrived, arrived))
                )

    def unwatch(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()

    def check_agree(self, device: torch.device) -> None:
        """Once, at the root's first forward: do the trainable replicas hold the same
        values on every rank? One small all-reduce per group; raises on every rank alike."""
        params = [p for p in self.averaged if p.requires_grad]
        if self.ranks == 1 or not params:
            return
        differ = collectives.differ_across(params, self.groups, device, self.tag)
        if bool(differ.any()):
            index = int(differ.nonzero()[0, 0])
            raise ValueError(
                f"fsdp_lite: ignored parameter of shape {tuple(params[index].shape)} (and "
                f"{int(differ.sum()) - 1} more) holds different values on different ranks at "
                "the first forward: ignored parameters are replicas that the ranks train "
                "together, so they must start equal. Seed every rank the same before "
                "building the model, pass sync_module_states=True to FSDPModule (rank 0's "
                "values are broadcast at wrap time), or load a checkpoint before training"
            )

    def start(self) -> Averaging | None:
        """Issue the averaging of the gradients this backward left (None: nothing to do)."""
        if self.ranks == 1:
            return None
        trainable = [p for p in self.averaged if p.requires_grad]
        grads = [p.grad for p in trainable if p.grad is not None]
        if not grads:
            return None
        tag = self.tag
        if len(grads) < len(trainable):  # ranks that disagree on which raise (divergence.py)
            held = ",".join(str(i) for i, p in enumerate(trainable) if p.grad is not None)
            crc = zlib.crc32(held.encode())
            name = f"{tag.name}, {len(grads)} of {len(trainable)} with a gradient ({crc:08x})"
            tag = Tag(name, tag.ledger)
        return Averaging(grads, self.groups, self.ranks, tag)


def _arrived(arrived: Callable[[], None], param: torch.Tensor) -> None:
    arrived()


class Averaging:
    """Gradients summed over each group in turn and divided by the number of ranks: one
    all-reduce per (device, dtype) bucket and group (in fp32 for lower-precision grads),
    the results copied back into the same gradient tensors."""

    def __init__(
        self,
        grads: list[torch.Tensor],
        groups: list[collectives.ProcessGroup],
        ranks: int,
        tag: Tag,
    ) -> None:
        self.groups = groups
        self.ranks = ranks
        self.tag = tag
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            if g.layout is not torch.strided:
                raise RuntimeError(
                    f"fsdp_lite: an ignored parameter has a {g.layout} gradient (shape "
                    f"{tuple(g.shape)}): fsdp_lite averages dense gradients only; use a "
                    "dense one (e.g. nn.Embedding(sparse=False))"
                )
            dtype = torch.promote_types(g.dtype, torch.float32)
            by_kind.setdefault((g.device, dtype), []).append(g)
        with torch.no_grad():
            self.buckets = [
                (torch.cat([g.reshape(-1).to(dtype) for g in gs]), gs)
                for (_, dtype), gs in by_kind.items()
            ]
        self.handles = [self._all_reduce(bucket, groups[0]) for bucket, _ in self.buckets]

    def _all_reduce(
        self, bucket: torch.Tensor, group: collectives.ProcessGroup
    ) -> collectives.Handle | None:
        return collectives.all_reduce(bucket, group, kind=KIND, tag=self.tag, async_op=True)

    def finish(self) -> None:
        """Wait, reduce over the next group, divide, write the averages back."""
        for group in self.groups[1:]:
            self._wait()
            self.handles = [self._all_reduce(bucket, group) for bucket, _ in self.buckets]
        self._wait()
        with torch.no_grad():
            for bucket, gs in self.buckets:
                bucket.div_(self.ranks)
                offset = 0
                for g in gs:
                    g.copy_(bucket[offset : offset + g.numel()].view(g.shape))
                    offset += g.numel()

    def _wait(self) -> None:
        for handle in self.handles:
            if handle is not None:
                handle.wait()
        self.handles = []
