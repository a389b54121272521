"""The import graph of hone's own modules has no cycles, and the config imports nothing above it.

Every module under ``hone/`` is parsed (never imported) and each ``import hone...`` /
``from hone... import`` becomes an edge to the module it names. Imports inside functions
count too: a lazy import only hides a circle from the interpreter, the two modules still
depend on each other. Imports under ``if TYPE_CHECKING:`` do not count (they never run).
"""

import ast
from pathlib import Path

import pytest

import hone

ROOT = Path(hone.__file__).resolve().parent
#: The layers hone.config must never import: the config is the bottom layer that all of them read.
ABOVE_CONFIG = ("hone.models", "hone.train", "hone.data", "hone.transforms")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The hone module that ``name`` (a module or a name inside one) is read from."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def hone_imports(module: str, path: Path) -> set[str]:
    """The hone modules ``module`` imports, anywhere in its body except ``if TYPE_CHECKING:``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names if a.name.split(".")[0] == "hone")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            if base.split(".")[0] == "hone":
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in MODULES else _resolve(base))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    found.discard(None)  # type: ignore[arg-type]
    found.discard(module)
    return found


GRAPH = {module: hone_imports(module, path) for module, path in MODULES.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(cycles)


def test_the_graph_is_read():
    assert len(MODULES) > 50
    assert "hone.data.formats" in GRAPH["hone.data.chat"]  # a module-level import
    assert "hone.data.prepare" in GRAPH["hone.train.run"]  # an import inside a function


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles_between_hone_modules():
    assert find_cycles(GRAPH) == []


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m == "hone.config" or m.startswith("hone.config.")))
def test_the_config_imports_nothing_above_it(module):
    upward = sorted(m for m in GRAPH[module] if any(m == layer or m.startswith(layer + ".") for layer in ABOVE_CONFIG))
    assert upward == [], f"{module} imports {upward}; the config is the bottom layer: move the shared piece into hone.config"
