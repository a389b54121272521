"""The import graph of hone's own modules has no cycles, and every package imports only from
the layers below it (kernels and config at the bottom, the CLI at the top).

Every module under ``hone/`` is parsed (never imported) and each ``import hone...`` /
``from hone... import`` becomes an edge to the module it names. Imports inside functions
count too: a lazy import only hides a circle from the interpreter, the two modules still
depend on each other. So do imports under ``if TYPE_CHECKING:``: they never run, but a module
that names another's types is built around it.
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


def hone_imports(module: str, path: Path, type_only: bool = True) -> set[str]:
    """The hone modules ``module`` imports, anywhere in its body; those under ``if TYPE_CHECKING:``
    only when ``type_only`` (a type-only import still ties the two modules' designs together)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if not type_only and isinstance(node, ast.If) and _type_checking_only(node):
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


#: hone's packages from the bottom up: a module imports from its own package or from a lower
#: layer, never from a higher one or a sibling of its layer. The contracts the transforms and
#: the trainer share (hone.runtime) sit below both; run-directory names (hone.run_files) below all.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("hone", "hone.errors"),
    ("hone.atomic", "hone.paths", "hone.processes", "hone.run_files", "hone.units"),
    ("hone.kernels", "hone.config"),
    ("hone.parallel",),  # expert parallelism: kernels + torch.distributed; below the experts backend that calls it
    ("hone.models", "hone.track", "hone.convert"),
    ("hone.data",),
    ("hone.runtime",),
    ("hone.transforms",),
    ("hone.train",),
    ("hone.bench", "hone.export", "hone.preflight", "hone.testing"),
    ("hone.cli",),
    ("hone.__main__",),
)


def package_of(module: str) -> str:
    """The entry of :data:`LAYERS` that ``module`` belongs to (its longest matching prefix)."""
    names = [name for layer in LAYERS for name in layer if module == name or (name != "hone" and module.startswith(name + "."))]
    assert names, f"{module} belongs to no layer of LAYERS: place its package there"
    return max(names, key=len)


LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from another package of the same or a higher layer."""
    found = []
    for module, imported in sorted(graph.items()):
        here = package_of(module)
        for other in sorted(imported):
            there = package_of(other)
            if there != here and LAYER_OF[there] >= LAYER_OF[here]:
                found.append(f"{module} -> {other}")
    return found


def test_type_only_imports_are_counted():
    assert "hone.models.attention.layout" in GRAPH["hone.transforms.base"]  # under TYPE_CHECKING
    assert "hone.models.attention.layout" not in hone_imports(
        "hone.transforms.base", MODULES["hone.transforms.base"], type_only=False
    )


def test_the_layer_check_finds_an_upward_import():
    graph = {"hone.transforms.x": {"hone.train.y"}, "hone.train.y": {"hone.transforms.x"}, "hone.track.z": {"hone.models.w"}}
    assert upward_imports(graph) == ["hone.track.z -> hone.models.w", "hone.transforms.x -> hone.train.y"]


def test_every_module_belongs_to_a_layer():
    for module in GRAPH:
        package_of(module)


def test_no_package_imports_from_a_higher_layer():
    assert upward_imports(GRAPH) == []
