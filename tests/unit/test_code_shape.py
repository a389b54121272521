"""The trainer and the transforms stay readable: no function in them grows past a screen.

Why a test: the loop and the planner are the code every contributor reads first, and both once
grew into functions of hundreds of lines (a 347-line training loop, a 149-line memory estimate)
that nobody could change safely. The limits are those of the redesign (issue 24): 100 lines in
``hone/train``, 80 in ``hone/transforms``. The source is parsed, never imported.
"""

import ast
from pathlib import Path

import pytest

import hone

ROOT = Path(hone.__file__).resolve().parent
LIMITS = {"train": 100, "transforms": 80}


def long_functions(package: Path, limit: int) -> list[str]:
    """``path:line name (N lines)`` of every function or method under ``package`` longer than ``limit``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path, 6) == []
    assert long_functions(tmp_path, 5) == [f"{tmp_path.name}/m.py:5 long (6 lines)"]


@pytest.mark.parametrize("package", sorted(LIMITS))
def test_no_function_is_longer_than_the_limit(package):
    assert long_functions(ROOT / package, LIMITS[package]) == []
