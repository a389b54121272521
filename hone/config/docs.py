"""Render the config reference (docs/config.md) from the schema itself.

The field docstrings are the one place a key is described; this keeps the docs from drifting
(a test fails when docs/config.md is stale: regenerate it with ``python -m hone.config.docs``).
"""

import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from hone.config.data import AlpacaDataset, ChatDataset, CompletionDataset, PretokenizedDataset
from hone.config.errors import _models_in
from hone.config.root import HoneConfig

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _type_name(annotation: typing.Any) -> str:
    """A short, readable rendering of a field's type for the reference tables."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return "dataset entry" if _models_in(annotation) else _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(repr(a) if not isinstance(a, str) else a for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{value!r}`" if not isinstance(value, Path) else f"`{value}`"


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    return ["| key | type | default | meaning |", "|---|---|---|---|", *_rows(model, prefix)]


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    """One row per key; a nested section (``logging.wandb``) lists its keys under its prefix."""
    rows = []
    for name, field in model.model_fields.items():
        nested = _models_in(field.annotation)
        if nested and name not in ("datasets", "test_datasets"):
            if len(nested) == 1:
                rows += _rows(nested[0], f"{prefix}{name}.")
            continue
        doc = (field.description or "").replace("\n", " ").replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | {_type_name(field.annotation)} | {_default(field)} | {doc} |")
    return rows


def render() -> str:
    out = [
        "# Config reference",
        "",
        "Generated from the schema by `python -m hone.config.docs`; do not edit by hand.",
        "Every key is validated before anything is loaded: `hone validate CFG`.",
        "",
    ]
    for name, field in HoneConfig.model_fields.items():
        (section,) = _models_in(field.annotation)
        out += [f"## `{name}`", "", (section.__doc__ or "").strip(), ""]
        out += _table(section, f"{name}.")
        out.append("")
    out += ["## Dataset entries (`data.datasets[i]`, `data.test_datasets[i]`)", ""]
    for variant in (AlpacaDataset, ChatDataset, CompletionDataset, PretokenizedDataset):
        tag = typing.get_args(variant.model_fields["type"].annotation)[0]
        out += [f"### `type: {tag}`", "", (variant.__doc__ or "").strip(), ""]
        out += _table(variant, "")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if DOC_PATH.read_text() == text else 1)
    from hone.atomic import atomic_write_text

    atomic_write_text(DOC_PATH, text)
    print(f"wrote {DOC_PATH}")
