"""No ``torch.autograd.Function`` in hone returns from its forward a buffer it filled in place.

Why a test: torch 2.11 (the GPU machines' version and hone's lower bound) traces such a forward
under ``torch.compile`` as if the output did not depend on the inputs, so every gradient through
it comes out exactly zero and the custom backward never runs, while the forward stays right and
the loss looks normal. It hid twice: the expert-parallel exchange (``dist.all_to_all_single``
into ``torch.empty_like``) and the weighted sum of the grouped experts path (``out += ...`` into
``torch.zeros``). torch 2.13, which CI runs, traces both right, so a parity test alone would not
catch the next one here; this check reads the source, whatever torch is installed.

Flagged: in a Function's ``forward``, a name bound to a new tensor (``torch.zeros``, ``empty``,
``full``, their ``_like`` and ``new_`` forms) that is then written in place (``+=``, item or
slice assignment, a method ending in ``_``, or a ``torch.distributed`` call filling it). Backward
methods may do it (their outputs are the gradients themselves). :data:`EAGER_ONLY` names the
Functions that never run traced, with the reason.
"""

import ast
from pathlib import Path

import hone

ROOT = Path(hone.__file__).resolve().parent

#: class name: why its forward never runs under Dynamo.
EAGER_ONLY = {
    "_Exchange": "hone.parallel.exchange.exchange uses torch's functional collective while compiling",
    "_TiledLayerFunction": "applied from a torch.compiler.disable'd forward (hone/transforms/tiled_layers.py)",
    "_TiledMLPFunction": "applied from a torch.compiler.disable'd forward (hone/transforms/tiled_mlp.py)",
}
_FACTORIES = {"zeros", "empty", "full", "ones", "zeros_like", "empty_like", "full_like", "ones_like"}
_NEW = {"new_zeros", "new_empty", "new_full", "new_ones"}


def _is_function_class(node: ast.ClassDef) -> bool:
    names = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", None) for b in node.bases]
    return "Function" in names


def _new_buffer(value: ast.expr) -> bool:
    if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute):
        return False
    attr = value.func.attr
    return attr in _NEW or (attr in _FACTORIES and isinstance(value.func.value, ast.Name) and value.func.value.id == "torch")


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _written_in_place(forward: ast.FunctionDef) -> list[str]:
    """``name (line)`` of every new buffer of ``forward`` written in place."""
    buffers = {
        target.id
        for node in ast.walk(forward)
        if isinstance(node, ast.Assign) and _new_buffer(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(forward):
        names: list[str | None] = []
        if isinstance(node, ast.AugAssign):
            names.append(_root_name(node.target))
        elif isinstance(node, ast.Assign):
            names += [_root_name(t) for t in node.targets if isinstance(t, ast.Subscript)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr.endswith("_") and not node.func.attr.startswith("_"):
                names.append(_root_name(node.func.value))
            if _root_name(node.func) in ("dist", "distributed") and node.args:
                names.append(_root_name(node.args[0]))
        found += [f"{name} (line {node.lineno})" for name in names if name in buffers]
    return found


def in_place_forwards(package: Path) -> list[str]:
    """``path:Class: buffer (line N)`` for every Function forward of ``package`` that fills a new buffer."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(cls, ast.ClassDef) or not _is_function_class(cls) or cls.name in EAGER_ONLY:
                continue
            for item in cls.body:
                if isinstance(item, ast.FunctionDef) and item.name == "forward":
                    found += [f"{path.relative_to(package.parent)}:{cls.name}: {w}" for w in _written_in_place(item)]
    return found


def test_the_check_finds_each_way_of_filling_a_buffer(tmp_path):
    ways = ["out += x", "out[0] = x[0]", "out.copy_(x)", "dist.all_to_all_single(out, x)"]
    for i, way in enumerate(ways):
        (tmp_path / f"m{i}.py").write_text(
            "import torch\n\nclass F(torch.autograd.Function):\n    @staticmethod\n"
            f"    def forward(ctx, x):\n        out = torch.zeros_like(x)\n        {way}\n        return out\n"
        )
    (tmp_path / "fine.py").write_text(
        "import torch\n\nclass G(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n"
        "        out = x * 2\n        out = out + x\n        return out\n\n    @staticmethod\n"
        "    def backward(ctx, g):\n        d = torch.empty_like(g)\n        d[:] = g\n        return d\n"
    )
    found = in_place_forwards(tmp_path)
    assert [f.split(":")[0] for f in found] == [f"{tmp_path.name}/m{i}.py" for i in range(len(ways))]


def test_no_function_forward_fills_a_new_buffer_in_place():
    assert in_place_forwards(ROOT) == []


def test_the_eager_only_functions_exist():
    """A renamed or removed Function must leave the allowance too."""
    names = {
        cls.name
        for path in ROOT.rglob("*.py")
        for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(cls, ast.ClassDef) and _is_function_class(cls)
    }
    assert set(EAGER_ONLY) <= names
