"""The import graph: the client floor (txmq/) stands on nothing above it, the CLI is on top
of everything and imported by nothing, no package imports another that imports it back, and
nothing imports txmq's folders by their top-level names (they are installed under txmq)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: repository folder -> installed package name
FOLDERS = {"txmq": "txmq"}
ABOVE_THE_FLOOR = (
    "txmq.broker",
    "txmq.outbox",
    "txmq.spark",
    "txmq.migrations",
    "txmq.cli",
    "txmq.namesrv",
    "txmq.console",
)
TOP_LEVEL_NAMES = ("broker", "outbox", "spark", "migrations", "cli", "namesrv", "console")


def _within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _real_files(folder: Path) -> list[Path]:
    """Python files under ``folder``."""
    return sorted(folder.rglob("*.py"))


def _module(folder: str, path: Path) -> str:
    parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([FOLDERS[folder], *parts])


def _package(module: str, path: Path) -> str:
    """A module's package; a package's ``__init__`` (the names it re-exports from its
    modules and subpackages) counts as a layer of its own above them."""
    return f"{module}.__init__" if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """Every module ``path`` imports, anywhere in it (functions and TYPE_CHECKING too);
    ``from package import module`` counts as the module."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                drop = node.level - 1 if is_pkg else node.level
                anchor = anchor[: len(anchor) - drop]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names]
            modules = [n for n in names if n in known]
            found.update(modules)
            if len(modules) < len(names):
                found.add(base)
    return found


def _graph() -> tuple[dict[str, set[str]], dict[str, str]]:
    """module -> imported txmq modules; module -> its package."""
    modules: dict[str, tuple[Path, str]] = {}
    for folder in FOLDERS:
        for path in _real_files(ROOT / folder):
            modules[_module(folder, path)] = (path, folder)
    edges: dict[str, set[str]] = {}
    packages: dict[str, str] = {}
    for name, (path, _) in modules.items():
        packages[name] = _package(name, path)
        edges[name] = {m for m in _imports(path, name, set(modules)) if m in modules}
    return edges, packages


def test_the_graph_is_read_from_the_real_folders() -> None:
    edges, packages = _graph()
    assert "txmq.broker.server" in edges and "txmq.cli" in edges
    assert "txmq.broker.store" in edges["txmq.broker.server"] or any(
        m.startswith("txmq.broker.store") for m in edges["txmq.broker.server"]
    )
    assert packages["txmq.broker.store.commitlog"] == "txmq.broker.store"
    assert packages["txmq.broker"] == "txmq.broker.__init__"


def test_the_client_floor_imports_nothing_above_it() -> None:
    edges, _ = _graph()
    wrong = sorted(
        f"{mod} imports {dep}"
        for mod, deps in edges.items()
        if not _within(mod, *ABOVE_THE_FLOOR)
        for dep in deps
        if _within(dep, *ABOVE_THE_FLOOR)
    )
    assert wrong == []


def test_nothing_imports_the_cli() -> None:
    edges, _ = _graph()
    wrong = sorted(
        f"{mod} imports {dep}"
        for mod, deps in edges.items()
        if not _within(mod, "txmq.cli")
        for dep in deps
        if _within(dep, "txmq.cli")
    )
    assert wrong == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_package_imports_one_that_imports_it_back() -> None:
    edges, packages = _graph()
    between: dict[str, set[str]] = defaultdict(set)
    for mod, deps in edges.items():
        for dep in deps:
            a, b = packages[mod], packages[dep]
            if a != b:
                between[a].add(b)
    assert _cycles(between) == [], dict(between)


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("folder", ["txmq", "tests", "examples", "bench"])
def test_nothing_imports_txmqs_folders_by_their_top_level_names(folder: str) -> None:
    wrong = []
    for path in _real_files(ROOT / folder):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            rel = path.relative_to(ROOT)
            wrong += [f"{rel}: {n}" for n in names if n.split(".")[0] in TOP_LEVEL_NAMES]
    assert wrong == []


def test_the_name_server_and_the_broker_share_only_the_wire() -> None:
    """Name servers and brokers are separate processes that speak the protocol: neither
    imports the other."""
    edges, _ = _graph()
    wrong = sorted(
        f"{mod} imports {dep}"
        for mod, deps in edges.items()
        for dep in deps
        if (_within(mod, "txmq.namesrv") and _within(dep, "txmq.broker"))
        or (_within(mod, "txmq.broker") and _within(dep, "txmq.namesrv"))
    )
    assert wrong == []
