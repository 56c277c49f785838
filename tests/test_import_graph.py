"""The import graph of ``promptcache`` has no cycles: between modules, and between the top-level
packages (``core``, ``engines``, ``server``, ...), read from the source with ``ast`` (every
import counts, also inside functions, except under ``if TYPE_CHECKING:``). The packages keep
their layers (``LAYERS``: each imports only lower ones), and production code never imports
``promptcache.testing``."""

from __future__ import annotations

import ast
from pathlib import Path

import promptcache

ROOT = Path(promptcache.__file__).parent


def module_files() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ["promptcache", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return getattr(t, "id", None) == "TYPE_CHECKING" or getattr(t, "attr", None) == "TYPE_CHECKING"


def imported_by(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports: ``from a import b`` names ``a.b`` where that is a
    module, else ``a`` (or the nearest enclosing module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def nearest(mod: str) -> str | None:
        while mod and mod not in known:
            mod = mod.rpartition(".")[0]
        return mod or None

    found: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                todo.extend(child.orelse)
                continue
            if isinstance(child, ast.Import):
                found.update(m for a in child.names if (m := nearest(a.name)))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([child.module] if child.module else []))
                for a in child.names:
                    m = f"{base}.{a.name}" if f"{base}.{a.name}" in known else nearest(base)
                    if m:
                        found.add(m)
            todo.append(child)
    found.discard(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def module_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_by(name, path, set(files)) for name, path in files.items()}


def top_package(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles_between_modules():
    graph = module_graph()
    assert len(graph) > 100 and graph["promptcache.core.cache"]  # the walk sees the package
    assert cycles(graph) == []


def test_no_import_cycles_between_top_level_packages():
    assert cycles(package_graph()) == []


# lowest first; a package imports only packages of lower layers (never one beside it). serving
# is the engine-neutral loop; engines (the Engine protocol, the registry, the torch / mlx
# adapters) implement its ModelRunner and subclass its CachedEngine, so they sit above it.
LAYERS = [
    {"promptcache", "promptcache.errors"},
    {"promptcache.core", "promptcache.models", "promptcache.tools"},
    {"promptcache.serving", "promptcache.vllm"},
    {"promptcache.engines"},
    {"promptcache.server", "promptcache.testing"},
    {"promptcache.cli"},
]


def package_graph() -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for name, deps in module_graph().items():
        top = top_package(name)
        packages.setdefault(top, set()).update(top_package(d) for d in deps)
    for top, deps in packages.items():
        deps.discard(top)
    return packages


def test_packages_import_only_lower_layers():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    packages = package_graph()
    assert set(packages) == set(layer), "a new top-level package: give it a layer in LAYERS"
    upward = sorted(
        f"{top} imports {dep}"
        for top, deps in packages.items()
        for dep in deps
        if layer[dep] >= layer[top]
    )
    assert upward == []


def test_no_production_module_imports_testing():
    graph = module_graph()
    users = sorted(
        name
        for name, deps in graph.items()
        if top_package(name) != "promptcache.testing"
        and any(top_package(d) == "promptcache.testing" for d in deps)
    )
    assert users == []


def test_the_vllm_connector_needs_neither_the_server_nor_an_engine():
    graph = module_graph()
    seen, todo = set(), ["promptcache.vllm.connector"]
    while todo:  # everything the connector can import, lazily too
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    assert {top_package(n) for n in seen} <= {"promptcache", "promptcache.core", "promptcache.vllm"}
