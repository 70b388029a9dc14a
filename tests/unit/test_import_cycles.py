"""No import cycles among the project's modules (every .py file under shared/ and services/).

The import graph is built statically with `ast`, without importing anything:

- Every `import x` and `from x import y` counts, wherever it is: at module level, inside
  functions (a deferred import still makes the two modules depend on each other; deferring
  one is how a cycle is usually hidden, not how it is broken), under `try:`, and under
  `if TYPE_CHECKING:`. A TYPE_CHECKING import never runs, but it is the other common way to
  hide a cycle, the issue asks for no import cycle at all, and the fix is the same (move what
  both modules need into a third one), so it counts too; none closes a cycle today.
- Relative imports are resolved against the importing module's package.
- `from pkg import name` where `pkg.name` is a project module counts as importing
  `pkg.name`; otherwise it imports `pkg` itself.
- Importing `a.b.c` also runs `a/__init__.py` and `a/b/__init__.py`, so it makes an edge to
  each of those packages too, except the ones that enclose the importing module: those ran
  before it did, so the import cannot run them again. A package `__init__` that imports no
  project module has no edges out and can never close a cycle, so this only matters for the
  few that re-export their submodules (e.g. shared/engine_client/__init__.py).
- Imports of modules outside the project (stdlib, third-party) make no edge.
- `importlib.import_module(name)` calls (plugin loading by a configured dotted path) are not
  seen: their targets are data, not code.

The strongly connected components of that graph (Tarjan's algorithm, iterative) with more
than one module, or a module that imports itself, are the cycles; the failure lists each,
with every import inside it as `importer:line -> imported`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "services")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: str
    line: int


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the given top-level packages."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _project_module(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a project module, if any."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]
) -> Iterator[str]:
    """The project modules one import statement imports directly."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            found = _project_module(alias.name, modules)
            if found:
                yield found
        return
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        if node.level > 1:
            package = package[: -(node.level - 1)]
        base = ".".join([*package, node.module] if node.module else package)
    else:
        base = node.module or ""
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if submodule in modules:
            yield submodule
        else:
            found = _project_module(base, modules)
            if found:
                yield found


def _with_packages(target: str, importer: str, modules: dict[str, Path]) -> Iterator[str]:
    """`target` and the packages above it that importing it runs (not the importer's own)."""
    enclosing = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 2)}
    parts = target.split(".")
    for i in range(1, len(parts)):
        package = ".".join(parts[:i])
        if package in modules and package not in enclosing:
            yield package
    yield target


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, list[Edge]]:
    """Every project module -> the imports of project modules it makes."""
    modules = module_files(root, packages)
    graph: dict[str, list[Edge]] = {}
    for module, path in modules.items():
        edges: dict[Edge, None] = {}  # one edge per statement and target, in order
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(node, module, is_package, modules):
                for dep in _with_packages(target, module, modules):
                    edges[Edge(module, dep, rel, node.lineno)] = None
        graph[module] = list(edges)
    return graph


def strongly_connected(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = []
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        work.append((start, iter(sorted({e.target for e in graph[start]}))))
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted({e.target for e in graph[child]}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def find_cycles(graph: dict[str, list[Edge]]) -> list[tuple[list[str], list[Edge]]]:
    """Each cycle: its modules and the imports among them."""
    cycles = []
    for component in strongly_connected(graph):
        members = set(component)
        edges = [e for m in component for e in graph[m] if e.target in members]
        if len(component) > 1 or edges:
            cycles.append((component, sorted(edges, key=lambda e: (e.source, e.line, e.target))))
    return cycles


def describe(cycles: list[tuple[list[str], list[Edge]]]) -> str:
    lines = [f"{len(cycles)} import cycle(s) among the project's modules:"]
    for members, edges in cycles:
        lines.append(f"- {' <-> '.join(members)}")
        lines += [f"    {e.path}:{e.line} -> {e.target}" for e in edges]
    lines.append(
        "Break each by moving what the modules share into a module they both import; "
        "deferring an import into a function does not count as breaking it."
    )
    return "\n".join(lines)


def test_no_import_cycles() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 100, "the project's modules were not found"
    cycles = find_cycles(graph)
    assert not cycles, describe(cycles)


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_detector_finds_a_cycle(tmp_path: Path) -> None:
    """A deferred relative import closing a three-module loop, a self-import, and a clean module."""
    write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import thing\n",
            "pkg/b.py": "import os\n\nfrom . import c\n",
            "pkg/c.py": "def f():\n    from .a import x\n    return x\n",
            "pkg/selfish.py": "import pkg.selfish\n",
            "pkg/clean.py": "from pkg import a, b\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert {e.target for e in graph["pkg.clean"]} == {"pkg.a", "pkg.b"}  # submodules, not pkg
    assert {e.target for e in graph["pkg.b"]} == {"pkg.c"}  # os: not the project's
    cycles = find_cycles(graph)
    assert [members for members, _ in cycles] == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.selfish"]]
    edges = {(e.path, e.line, e.target) for e in cycles[0][1]}
    assert edges == {
        ("pkg/a.py", 1, "pkg.b"),
        ("pkg/b.py", 3, "pkg.c"),
        ("pkg/c.py", 2, "pkg.a"),
    }
    message = describe(cycles)
    assert "pkg/c.py:2 -> pkg.a" in message and "pkg.a <-> pkg.b <-> pkg.c" in message


def test_detector_sees_type_checking_and_package_init_edges(tmp_path: Path) -> None:
    """An `if TYPE_CHECKING:` import counts, and so does a package __init__ that re-exports a
    module which imports the package from outside it; a sibling import inside the package
    does not make an edge to its own __init__."""
    write(
        tmp_path,
        {
            "top/__init__.py": "",
            "top/api/__init__.py": "from top.api.client import Client\n",
            "top/api/client.py": "from top.api import base\n",
            "top/api/base.py": "",
            "top/user.py": (
                "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from top.api.base import B\n"
            ),
            "top/api/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import top.user\n",
        },
    )
    graph = import_graph(tmp_path, ["top"])
    assert {e.target for e in graph["top.user"]} == {"top.api", "top.api.base"}
    assert {e.target for e in graph["top.api.client"]} == {"top.api.base"}
    assert find_cycles(graph) == []
    # top.api.base now imports top.user: user -> top.api (its __init__) -> client -> base -> user.
    write(tmp_path, {"top/api/base.py": "import top.user\n"})
    cycles = find_cycles(import_graph(tmp_path, ["top"]))
    assert [members for members, _ in cycles] == [
        ["top.api", "top.api.base", "top.api.client", "top.user"]
    ]
