"""Auto-wrap policies: callables ``policy(module) -> bool``.

A policy is asked about every submodule of the module being wrapped, bottom-up
(children before parents); ``True`` makes that submodule its own unit. The module
passed to ``FSDPModule`` itself is always a unit (the root), whatever the policy says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torch import nn

from fsdp_lite.core.optim_view import replicated_ranks
from fsdp_lite.core.tree import is_ignored, unit_of

Policy = Callable[[nn.Module], bool]


def by_type(*module_classes: type[nn.Module]) -> Policy:
    """Wrap every instance of the given classes, e.g. ``by_type(TransformerBlock)``."""
    if not module_classes or not all(
        isinstance(c, type) and issubclass(c, nn.Module) for c in module_classes
    ):
        raise TypeError(f"wrap.by_type needs nn.Module subclasses, got {module_classes!r}")

    def policy(module: nn.Module) -> bool:
        return isinstance(module, module_classes)

    return policy


def by_size(min_num_params: int) -> Policy:
    """Wrap a module once the parameters it holds outside nested units reach ``min_num_params``."""
    if min_num_params < 1:
        raise ValueError(f"wrap.by_size needs min_num_params >= 1, got {min_num_params}")

    def policy(module: nn.Module) -> bool:
        return sum(p.numel() for _, _, p in unowned_parameters(module)) >= min_num_params

    return policy


def instances(*modules: nn.Module) -> Policy:
    """Wrap exactly these module objects, e.g. ``instances(model.wte, model.lm_head)``:
    the embedding and the head as units of their own keep the root small (torchtitan's
    layout). A module whose every parameter is tied to one outside it gets no unit: the
    lowest unit containing every use holds the shared weight."""
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"wrap.instances needs nn.Module objects, got {modules!r}")
    ids = {id(m) for m in modules}

    def policy(module: nn.Module) -> bool:
        return id(module) in ids

    return policy


def embeddings_and_head(model: nn.Module) -> Policy:
    """``instances`` of the model's input embedding and output head, as Hugging Face's
    ``get_input_embeddings()`` / ``get_output_embeddings()`` name them; a head tied to the
    embedding stays with the root, which then holds the shared weight. Combine with the
    blocks' policy: ``any_of(by_type(*transformer_layers(model)), embeddings_and_head(model))``.
    """
    getters = ("get_input_embeddings", "get_output_embeddings")
    if not all(callable(getattr(model, g, None)) for g in getters):
        raise TypeError(
            f"wrap.embeddings_and_head: {type(model).__name__} has no get_input_embeddings() / "
            "get_output_embeddings(); name the modules yourself: wrap.instances(model.embed, "
            "model.head)"
        )
    found = (model.get_input_embeddings(), model.get_output_embeddings())
    modules = [m for m in found if m is not None]
    if len(modules) == 2 and _share_a_parameter(*modules):
        modules = []  # tied: the shared weight stays in the root
    return instances(*modules) if modules else _never


def _share_a_parameter(a: nn.Module, b: nn.Module) -> bool:
    return bool({id(p) for p in a.parameters()} & {id(p) for p in b.parameters()})


def _never(module: nn.Module) -> bool:
    return False


def transformer_layers(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The layer classes a Hugging Face model says must not be split across devices
    (``_no_split_modules``, e.g. ``LlamaDecoderLayer``), found among ``model``'s modules.

    Use with ``by_type``: ``auto_wrap_policy=wrap.by_type(*wrap.transformer_layers(model))``.
    Raises if the model names none, or none of the named classes occurs in it.
    """
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    found: dict[str, type[nn.Module]] = {}
    for m in model.modules():
        if type(m).__name__ in names:
            found.setdefault(type(m).__name__, type(m))
    if not found:
        raise ValueError(
            f"wrap.transformer_layers: {type(model).__name__} names no layer classes in "
            f"_no_split_modules (or none of {sorted(names)} occurs in it); pass the block "
            "classes yourself: wrap.by_type(MyBlock)"
        )
    return tuple(found.values())


def any_of(*policies: Policy) -> Policy:
    """Wrap a module if any of ``policies`` would."""
    if not policies or not all(callable(p) for p in policies):
        raise TypeError("wrap.any_of needs one or more callable policies")

    def policy(module: nn.Module) -> bool:
        return any(p(module) for p in policies)

    return policy


def _is_unit(module: nn.Module) -> bool:
    return unit_of(module) is not None


def unowned_parameters(module: nn.Module):
    """``(module, attr, param)`` for parameters in ``module``'s tree not yet flattened by a unit.

    A unit's own registered parameters are its shards and are skipped; parameters left
    inside a nested unit (ties deferred to an ancestor) are included; ignored ones
    (``ignored.py``: left unsharded) are not.
    """
    seen: set[int] = set()
    for sub in module.modules(remove_duplicate=False):
        if _is_unit(sub) or id(sub) in seen:
            continue
        seen.add(id(sub))
        for attr, p in sub._parameters.items():
            if p is not None and replicated_ranks(p) is None:
                yield sub, attr, p


def param_locations(module: nn.Module) -> dict[int, list[str]]:
    """id(param) -> every module path it is registered under (ties show up more than once)."""
    where: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub._parameters.items():
            if p is not None:
                where.setdefault(id(p), []).append(f"{name}.{attr}" if name else attr)
    return where


def deferred_ties(
    child: nn.Module, paths: list[str], locations: dict[int, list[str]]
) -> set[int] | None:
    """Ids of the parameters of ``child`` (registered at ``paths``) also registered outside
    it: ties, left for the lowest enclosing unit that contains every use. None where every
    parameter it holds is such a tie: it gets no unit (it would own nothing)."""
    prefixes = [p + "." for p in paths]
    held = [p for _, _, p in unowned_parameters(child)]
    defer = {
        id(p)
        for p in held
        if any(not any(loc.startswith(pre) for pre in prefixes) for loc in locations.get(id(p), []))
    }
    return None if held and len(defer) == len({id(p) for p in held}) else defer


def apply_policy(root: nn.Module, policy: Policy, make_unit: Callable) -> None:
    """Replace, bottom-up, each submodule the policy picks by ``make_unit(sub, defer)``
    (``picks``; a module registered at several places becomes one unit, set at each)."""
    units: dict[int, nn.Module] = {}
    for pick in picks(root, policy):
        if not pick.again:
            units[id(pick.module)] = make_unit(pick.module, pick.defer)
        setattr(pick.parent, pick.name, units[id(pick.module)])


@dataclass(frozen=True)
class Pick:
    """A submodule the policy picked, at one of its registrations."""

    parent: nn.Module
    name: str  # its attribute on ``parent``
    module: nn.Module
    # Ids of its parameters also registered outside it (ties): left for the lowest
    # enclosing unit that contains every use.
    defer: set[int]
    again: bool  # picked at an earlier registration: the same unit


def picks(root: nn.Module, policy: Policy) -> Iterator[Pick]:
    """Each submodule of ``root`` the policy picks, bottom-up (children before parents):
    never a container (no forward of its own), an existing unit, an ignored module or
    anything inside one, nor a module that would own nothing but ties. The one walk that
    wrapping (``apply_policy``) and the planner (``planner/layout.py``) share; the caller
    acts on each pick (wraps it, or hides its parameters) before the walk goes on."""
    paths: dict[int, list[str]] = {}  # id(module) -> every path it is registered under
    for name, m in root.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(name)
    yield from _visit(_Walk(policy, param_locations(root), paths), root, "")


@dataclass
class _Walk:
    policy: Policy
    locations: dict[int, list[str]]  # id(param) -> every path it is registered under
    paths: dict[int, list[str]]  # id(module) -> every path it is registered under
    made: set[int] = field(default_factory=set)  # ids of the modules picked so far


def _visit(walk: _Walk, module: nn.Module, path: str) -> Iterator[Pick]:
    for name, child in list(module._modules.items()):  # every registration, shared too
        if child is None:
            continue
        if id(child) in walk.made:
            yield Pick(module, name, child, set(), again=True)
            continue
        if _is_unit(child) or is_ignored(child):
            continue  # an ignored module's subtree is never a unit, nor any part of it
        child_path = f"{path}{name}"
        yield from _visit(walk, child, child_path + ".")
        if isinstance(child, nn.ModuleList | nn.ModuleDict) or not walk.policy(child):
            continue  # containers have no forward of their own: never units
        defer = deferred_ties(child, walk.paths.get(id(child), [child_path]), walk.locations)
        if defer is None:
            continue
        walk.made.add(id(child))
        yield Pick(module, name, child, defer, again=False)
