"""The rules of the tree, read from the code: no import circle among files (imports inside
functions and under TYPE_CHECKING count), no module touching a private name of another
module's object, each floor importing only the floors beneath it, nothing importing the CLI,
and nothing importing txmq's folders by bare top-level names.  Each rule is shown failing on
a violation planted in a small tree of its own."""

from __future__ import annotations

import ast
import textwrap
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: who may import whom: each floor (by module prefix, the longest prefix wins) and the floors
#: it may import besides itself.  Read top down: the CLI on everything; the public faces
#: (txmq, txmq.sync, txmq.testing); programs (broker, name server, proxy); the application
#: side; admin; consumers; the client core; transports; the seam; server; shared; protocol.
FLOORS: dict[str, set[str]] = {
    "protocol": set(),
    "shared": {"protocol"},
    "server": {"protocol", "shared"},
    "port": {"protocol", "shared"},
    "transports": {"protocol", "shared", "port"},
    "client": {"protocol", "shared", "port"},
    "consumer": {"protocol", "shared", "port", "client"},
    "admin": {"protocol", "shared", "port", "client"},
    "application": {"protocol", "shared", "port", "client", "consumer", "application"},
    "broker": {"protocol", "shared", "server", "store"},
    "namesrv": {"protocol", "shared", "server"},
    # the gRPC proxy is a client of the brokers: it reuses the client core (routes from the
    # name servers, fault avoidance, connections, heartbeats) rather than a copy of it
    "proxy": {"protocol", "shared", "server", "port", "client"},
    "spark": {"protocol", "shared", "store"},
    "store": {"protocol", "shared"},
    "console": {"protocol", "shared", "server", "client", "consumer", "admin", "application"},
    "public": {
        *("protocol", "shared", "port", "transports", "client", "consumer", "admin"),
        *("application", "broker", "namesrv", "server"),
    },
    "cli": {
        *("protocol", "shared", "server", "port", "transports", "client", "consumer", "admin"),
        *("application", "broker", "namesrv", "spark", "store", "console", "public"),
        "proxy",
    },
}
#: module prefix -> floor
PLACES = {
    "txmq.protocol": "protocol",
    "txmq.security": "shared",
    "txmq.observability": "shared",
    "txmq.server": "server",
    "txmq.transports": "transports",
    "txmq.transports.port": "port",
    "txmq.client": "client",
    "txmq.consumer": "consumer",
    "txmq.admin": "admin",
    "txmq.sqla": "application",
    "txmq.outbox": "application",
    "txmq.saga": "application",
    "txmq.migrations": "application",
    "txmq.asgi": "application",  # FastAPI/Starlette lifespans and dependencies
    "txmq.broker": "broker",
    "txmq.broker.store": "store",
    "txmq.namesrv": "namesrv",
    "txmq.proxy": "proxy",
    "txmq.spark": "spark",
    "txmq.console": "console",
    "txmq": "public",
    "txmq.cli": "cli",
}
#: names of namedtuples' public API that begin with an underscore
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def read_tree(root: Path, package: str = "txmq") -> dict[str, Module]:
    """Every module of ``package`` (a folder under ``root``), parsed."""
    out: dict[str, Module] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        out[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    return out


def imports(module: Module, known: Iterable[str]) -> set[str]:
    """Every module of ``known`` that ``module`` imports, anywhere in it (functions and
    TYPE_CHECKING too); ``from package import module`` counts as the module."""
    known = set(known)
    found: set[str] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.name.split(".")
                drop = node.level - 1 if module.is_package else node.level
                anchor = anchor[: len(anchor) - drop]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names]
            if not all(n in known for n in names):
                names.append(base)
        else:
            continue
        for name in names:
            while name and name not in known:  # a name inside a module: the module
                name = name.rpartition(".")[0]
            if name and name != module.name:
                found.add(name)
    return found


def graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    return {name: imports(m, modules) for name, m in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
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
        for w in sorted(edges.get(v, ())):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def file_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Import circles among files.  A package's ``__init__`` re-exports its modules'
    names, so an edge into an ``__init__`` counts only from outside that package."""
    edges = graph(modules)
    for name, deps in edges.items():
        edges[name] = {d for d in deps if not (modules[d].is_package and name.startswith(d + "."))}
    return cycles(edges)


def package_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Import circles among packages (a package's ``__init__`` is a layer of its own above
    its modules: the names it re-exports)."""
    edges = graph(modules)

    def package(name: str) -> str:
        return f"{name}.__init__" if modules[name].is_package else name.rpartition(".")[0]

    between: dict[str, set[str]] = defaultdict(set)
    for name, deps in edges.items():
        for dep in deps:
            a, b = package(name), package(dep)
            if a != b:
                between[a].add(b)
    return cycles(between)


def floor_of(name: str, places: dict[str, str] = PLACES) -> str:
    best = max((p for p in places if name == p or name.startswith(p + ".")), key=len)
    return places[best]


def floor_violations(
    modules: dict[str, Module],
    floors: dict[str, set[str]] = FLOORS,
    places: dict[str, str] = PLACES,
) -> list[str]:
    """Each import of a module of a floor its own floor may not use."""
    wrong = []
    for name, deps in graph(modules).items():
        mine = floor_of(name, places)
        for dep in sorted(deps):
            theirs = floor_of(dep, places)
            if theirs != mine and theirs not in floors[mine]:
                wrong.append(f"{name} ({mine}) imports {dep} ({theirs})")
    return wrong


def _defined_privates(tree: ast.Module) -> set[str]:
    """The underscore names a module defines: functions, classes, methods, attributes it
    assigns (``self._x = ...``, ``obj._x = ...``), class attributes and slots."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            names.update(
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in NAMEDTUPLE_API


def private_reaches(modules: dict[str, Module]) -> list[str]:
    """Each use of a private name (``_x``) of another txmq module: imported from it, or
    reached on anything but ``self``, ``cls`` or ``super()`` where this module does not
    define that name itself (another module does: it is that module's object's).  Private
    names of other libraries are theirs to keep stable and are not counted here."""
    defined = {name: _defined_privates(m.tree) for name, m in modules.items()}
    anywhere = set().union(*defined.values())
    wrong = []
    for name, module in modules.items():
        own = defined[name]
        rel = module.path.relative_to(module.path.parents[len(name.split(".")) - 1])
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom):
                ours = node.level > 0 or (node.module or "").split(".")[0] == "txmq"
                for alias in node.names:
                    if ours and _private(alias.name):
                        wrong.append(f"{rel}:{node.lineno} imports {alias.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                value = node.value
                if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                    continue
                if (
                    isinstance(value, ast.Call)
                    and isinstance(value.func, ast.Name)
                    and value.func.id == "super"
                ):
                    continue
                if node.attr in own or node.attr not in anywhere:
                    continue
                wrong.append(f"{rel}:{node.lineno} reaches {ast.unparse(node)}")
    return sorted(set(wrong))


# -- the rules, on txmq ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def txmq_modules() -> dict[str, Module]:
    return read_tree(ROOT)


def test_the_tree_is_read_from_the_package(txmq_modules: dict[str, Module]) -> None:
    edges = graph(txmq_modules)
    assert "txmq.broker.server" in edges and "txmq.cli" in edges
    assert any(m.startswith("txmq.broker.store") for m in edges["txmq.broker.server"])
    assert floor_of("txmq.broker.store.commitlog") == "store"
    assert floor_of("txmq.transports.port") == "port"
    assert floor_of("txmq.transports.grpc.remote") == "transports"


def test_no_import_circle_among_files(txmq_modules: dict[str, Module]) -> None:
    assert file_cycles(txmq_modules) == []


def test_no_package_imports_one_that_imports_it_back(txmq_modules: dict[str, Module]) -> None:
    assert package_cycles(txmq_modules) == []


def test_each_floor_imports_only_the_floors_beneath_it(txmq_modules: dict[str, Module]) -> None:
    assert floor_violations(txmq_modules) == []


def test_no_module_reaches_a_private_name_of_another(txmq_modules: dict[str, Module]) -> None:
    assert private_reaches(txmq_modules) == []


def test_nothing_imports_the_cli(txmq_modules: dict[str, Module]) -> None:
    wrong = [
        f"{name} imports {dep}"
        for name, deps in graph(txmq_modules).items()
        if floor_of(name) != "cli"
        for dep in deps
        if floor_of(dep) == "cli"
    ]
    assert wrong == []


def test_the_core_names_no_transport() -> None:
    """The client core and the consumers find transports through the seam only."""
    modules = read_tree(ROOT)
    wrong = [
        f"{name} imports {dep}"
        for name, deps in graph(modules).items()
        if floor_of(name) in ("client", "consumer")
        for dep in deps
        if floor_of(dep) == "transports"
    ]
    assert wrong == []


def test_the_name_server_and_the_broker_share_only_the_wire(
    txmq_modules: dict[str, Module],
) -> None:
    """Name servers and brokers are separate processes that speak the protocol: neither
    imports the other."""
    wrong = [
        f"{name} imports {dep}"
        for name, deps in graph(txmq_modules).items()
        for dep in deps
        if {floor_of(name), floor_of(dep)} == {"broker", "namesrv"}
    ]
    assert wrong == []


@pytest.mark.parametrize("folder", ["txmq", "tests", "examples", "bench"])
def test_nothing_imports_txmqs_folders_by_bare_top_level_names(folder: str) -> None:
    bare = {p.name for p in (ROOT / "txmq").iterdir() if p.is_dir() and p.name != "__pycache__"}
    wrong = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            rel = path.relative_to(ROOT)
            wrong += [f"{rel}: {n}" for n in names if n.split(".")[0] in bare]
    assert wrong == []


# -- each rule, shown failing on a planted violation -----------------------------------------


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return read_tree(tmp_path)


def test_a_circle_among_files_is_found_through_functions_and_type_checking(
    tmp_path: Path,
) -> None:
    modules = _plant(
        tmp_path,
        {
            "txmq/__init__.py": "",
            "txmq/client/__init__.py": "",
            "txmq/client/a.py": "from txmq.client.b import B\n",
            "txmq/client/b.py": """\
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from txmq.client.c import C
                B = 1
            """,
            "txmq/client/c.py": """\
                def late():
                    from txmq.client import a
                C = 2
            """,
        },
    )
    assert file_cycles(modules) == [["txmq.client.a", "txmq.client.b", "txmq.client.c"]]


def test_a_circle_between_packages_is_found(tmp_path: Path) -> None:
    modules = _plant(
        tmp_path,
        {
            "txmq/__init__.py": "",
            "txmq/client/__init__.py": "",
            "txmq/client/a.py": "from txmq.consumer.b import B\nA = 1\n",
            "txmq/consumer/__init__.py": "",
            "txmq/consumer/b.py": "B = 1\ndef f():\n    from txmq.client.c import C\n",
            "txmq/client/c.py": "C = 1\n",
        },
    )
    assert file_cycles(modules) == []  # no circle among the files themselves
    assert package_cycles(modules) == [["txmq.client", "txmq.consumer"]]


def test_a_floor_importing_one_above_it_is_found(tmp_path: Path) -> None:
    modules = _plant(
        tmp_path,
        {
            "txmq/__init__.py": "",
            "txmq/protocol/__init__.py": "",
            "txmq/protocol/wire.py": "from txmq.client.core import BrokerClient\n",
            "txmq/client/__init__.py": "",
            "txmq/client/core.py": "class BrokerClient: ...\n",
            "txmq/server/__init__.py": "",
            "txmq/server/serving.py": "from txmq.protocol import wire\n",
        },
    )
    assert floor_violations(modules) == [
        "txmq.protocol.wire (protocol) imports txmq.client.core (client)"
    ]


def test_a_private_name_of_another_module_is_found(tmp_path: Path) -> None:
    modules = _plant(
        tmp_path,
        {
            "txmq/__init__.py": "",
            "txmq/a.py": """\
                from txmq.b import _helper
                class A:
                    def __init__(self, b):
                        self._mine = 1
                        b._stopping = True
                    def peek(self, other):
                        return other._mine, other._drop(), self._mine
            """,
            "txmq/b.py": """\
                def _helper(): ...
                class B:
                    _stopping = False
                    def _drop(self): ...
                    def point(self, p):
                        return p._replace(x=1)
            """,
        },
    )
    assert private_reaches(modules) == [
        "txmq/a.py:1 imports _helper",
        "txmq/a.py:5 reaches b._stopping",
        "txmq/a.py:7 reaches other._drop",
    ]


def test_an_import_of_the_cli_is_found(tmp_path: Path) -> None:
    modules = _plant(
        tmp_path,
        {
            "txmq/__init__.py": "",
            "txmq/cli/__init__.py": "def main(): ...\n",
            "txmq/admin/__init__.py": "",
            "txmq/admin/client.py": "def f():\n    from txmq.cli import main\n",
        },
    )
    assert floor_violations(modules) == ["txmq.admin.client (admin) imports txmq.cli (cli)"]
