"""The package's imports point down: ``core`` (the step) imports no ``build`` (wrap time),
add-on, ``fsdp.py`` or ``testing``; ``build`` no add-on, ``fsdp.py``, planner or
``testing``; ``fsdp.py`` no planner and no ``testing``; add-ons no ``testing``; and no
module reaches itself through imports, lazy ones (inside functions) and ``if
TYPE_CHECKING:`` ones included."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_lite"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str], with_typing: bool) -> set[str]:
    """fsdp_lite modules ``path`` imports (in ``if TYPE_CHECKING:`` blocks too, with
    ``with_typing``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            typing = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            if typing and not with_typing:
                continue
            if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("fsdp_lite"):
                for alias in child.names:
                    full = f"{child.module}.{alias.name}"
                    found.add(full if full in known else child.module)
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("fsdp_lite"))
            visit(child)

    visit(ast.parse(path.read_text()))
    return found & known


def _graph(with_typing: bool = False) -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(paths)
    graph = {name: _imports(path, known, with_typing) for name, path in paths.items()}
    # A package's own __init__ is not an edge to follow from inside it.
    return {name: {d for d in deps if d != name} for name, deps in graph.items()}


def _layer(name: str) -> str:
    for prefix in ("fsdp_lite.core", "fsdp_lite.build", "fsdp_lite.planner", "fsdp_lite.addons"):
        if name.startswith(prefix):
            return prefix
    return name


def test_core_and_addons_import_only_downwards() -> None:
    forbidden = {
        "fsdp_lite.core": (
            "fsdp_lite.build",
            "fsdp_lite.addons",
            "fsdp_lite.fsdp",
            "fsdp_lite.testing",
        ),
        "fsdp_lite.build": (
            "fsdp_lite.addons",
            "fsdp_lite.fsdp",
            "fsdp_lite.planner",
            "fsdp_lite.testing",
        ),
        "fsdp_lite.fsdp": ("fsdp_lite.planner", "fsdp_lite.testing"),
        "fsdp_lite.addons": ("fsdp_lite.planner", "fsdp_lite.testing"),
        "fsdp_lite.planner": ("fsdp_lite.testing",),
    }
    bad = []
    for name, deps in _graph().items():
        for dep in deps:
            if dep.startswith(forbidden.get(_layer(name), ())) and dep != "fsdp_lite":
                bad.append(f"{name} -> {dep}")
    core_to_top = [f"{n} -> fsdp_lite" for n, d in _graph().items() if n.startswith(
        "fsdp_lite.core") and "fsdp_lite" in d]  # fmt: skip
    assert not bad + core_to_top, bad + core_to_top


def test_no_import_cycles() -> None:
    graph = _graph(with_typing=True)
    graph.pop("fsdp_lite", None)  # the package re-exports everything; nothing imports it back
    for deps in graph.values():
        deps.discard("fsdp_lite")
    cycles = []
    for start in graph:
        stack = [(start, (start,))]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            for dep in graph.get(node, ()):
                if dep == start:
                    cycles.append(" -> ".join((*path, start)))
                elif dep not in seen:
                    seen.add(dep)
                    stack.append((dep, (*path, dep)))
    assert not cycles, cycles
