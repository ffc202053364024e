"""The rooms of `cluster/` stand on floors (docs/rooms.md): no circle between them, no room
reaching into another's modules, the ground floor importing no room, `dspark/` importing nothing
of `cluster/`.

Read from the source with `ast`, nothing imported: every import statement counts, at module
level, inside a function or under `if TYPE_CHECKING:` (a lazy import is still a dependency; it
only moves the circle from import time to the first call). Each sub-package of `cluster/` is a
room; each module at the top of `cluster/` is its own node on the ground floor.
"""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "cluster"


@dataclass(frozen=True)
class Import:
    path: Path  # the importing file
    line: int
    module: str  # the module it names: `cluster.store.client`, or `cluster.store` for `from cluster.store import X`
    names: tuple[str, ...] = ()  # `from module import names`


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path) -> list[Import]:
    """Every import in the file, anywhere in it, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append(Import(path, node.lineno, module, tuple(alias.name for alias in node.names)))
    return found


def rooms(root: Path) -> set[str]:
    return {p.parent.name for p in (root / PACKAGE).glob("*/__init__.py")}


def node_of(module: str) -> str | None:
    """The room (`store`) or ground-floor module (`config`) a `cluster.` module belongs to; None
    outside `cluster`, and for the package itself (`cluster/__init__.py`)."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2:
        return None
    return parts[1]


def targets(imp: Import, root: Path) -> list[str]:
    """The `cluster.` modules an import reaches: `from cluster import store, config` reaches
    `cluster.store` and `cluster.config`, `from cluster.store import client` (a module of the
    room, not a name of its `__init__`) reaches `cluster.store.client`."""
    if imp.module == PACKAGE:
        return [f"{PACKAGE}.{name}" for name in imp.names]
    folder = root / Path(*imp.module.split("."))
    submodules = [
        f"{imp.module}.{name}"
        for name in imp.names
        if (folder / f"{name}.py").exists() or (folder / name / "__init__.py").exists()
    ]
    return [imp.module, *submodules]


@dataclass(frozen=True)
class Graph:
    edges: dict[str, dict[str, list[Import]]]  # node -> node it imports -> the imports that make the edge
    reaching_in: list[tuple[Import, str]]  # an import of another room's module, and that module
    room_names: set[str]


def read_graph(root: Path = ROOT) -> Graph:
    room_names = rooms(root)
    edges: dict[str, dict[str, list[Import]]] = defaultdict(lambda: defaultdict(list))
    reaching_in = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        source = node_of(module_name(path, root))
        for imp in imports_of(path, root):
            for module in targets(imp, root):
                target = node_of(module)
                if target is None or target == source:
                    continue
                edges[source][target].append(imp)
                if target in room_names and len(module.split(".")) > 2:
                    reaching_in.append((imp, module))
    return Graph({k: dict(v) for k, v in edges.items()}, reaching_in, room_names)


def find_cycle(edges: dict[str, dict[str, list]]) -> list[str] | None:
    """One circle of the graph (its nodes, the first repeated at the end), None when it has none."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour: dict[str, int] = defaultdict(int)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = GREY
        stack.append(node)
        for nxt in sorted(edges.get(node, {})):
            if colour[nxt] == GREY:
                return stack[stack.index(nxt) :] + [nxt]
            if colour[nxt] == WHITE and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        colour[node] = BLACK
        return None

    for node in sorted(edges):
        if colour[node] == WHITE and (cycle := visit(node)):
            return cycle
    return None


def where(imp: Import, root: Path = ROOT) -> str:
    return f"{imp.path.relative_to(root)}:{imp.line}"


def describe_cycle(graph: Graph, cycle: list[str], root: Path = ROOT) -> str:
    steps = []
    for a, b in itertools.pairwise(cycle):
        first = graph.edges[a][b][0]
        steps.append(
            f"  {a} -> {b}  ({where(first, root)} imports {first.module}"
            f"{f' ({len(graph.edges[a][b])} imports in all)' if len(graph.edges[a][b]) > 1 else ''})"
        )
    return "the rooms import in a circle: " + " -> ".join(cycle) + "\n" + "\n".join(steps)


def test_the_rooms_import_in_no_circle():
    graph = read_graph()
    cycle = find_cycle(graph.edges)
    assert cycle is None, describe_cycle(graph, cycle)


def test_a_room_imports_another_room_only_from_its_package():
    graph = read_graph()
    lines = [
        f"  {where(imp)}: imports {module}; import the name from {'.'.join(module.split('.')[:2])} "
        f"(its __init__ exports the room's public names)"
        for imp, module in graph.reaching_in
    ]
    assert not lines, "a room reaches into another room's modules:\n" + "\n".join(lines)


def test_the_ground_floor_imports_no_room():
    graph = read_graph()
    lines = [
        f"  {where(imp)}: {source} imports {imp.module}"
        for source, out in graph.edges.items()
        if source not in graph.room_names
        for target, imps in out.items()
        if target in graph.room_names
        for imp in imps
    ]
    assert not lines, "the ground floor of cluster/ (every room uses it) imports a room:\n" + "\n".join(lines)


def test_dspark_imports_nothing_of_cluster():
    lines = [
        f"  {where(imp)}: imports {imp.module}"
        for path in sorted((ROOT / "dspark").rglob("*.py"))
        for imp in imports_of(path, ROOT)
        if imp.module.split(".")[0] == PACKAGE
    ]
    assert not lines, "dspark/ (pure PyTorch) imports cluster/:\n" + "\n".join(lines)


def test_the_check_sees_a_circle_and_a_reach_into_a_room(tmp_path):
    """The checks above on a small tree: a lazy import that closes a circle, an import of a
    room's module from outside it, a relative import."""
    files = {
        "cluster/__init__.py": "",
        "cluster/config.py": "",
        "cluster/store/__init__.py": "from cluster.store.client import Client\n",
        "cluster/store/client.py": "from cluster.config import X\n\ndef f():\n    from cluster.data import Ledger\n",
        "cluster/data/__init__.py": "from .ledger import Ledger\n",
        "cluster/data/ledger.py": "from cluster.store.client import Client\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = read_graph(tmp_path)
    cycle = find_cycle(graph.edges)
    assert cycle in (["data", "store", "data"], ["store", "data", "store"])
    assert "cluster/store/client.py:4" in describe_cycle(graph, cycle, tmp_path)
    assert [(where(imp, tmp_path), module) for imp, module in graph.reaching_in] == [
        ("cluster/data/ledger.py:1", "cluster.store.client")
    ]
    assert set(graph.edges["data"]) == {"store"}  # `from .ledger import`: within its room
    (tmp_path / "cluster/store/client.py").write_text("from cluster.config import X\n")
    assert find_cycle(read_graph(tmp_path).edges) is None
