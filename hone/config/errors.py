"""Turn pydantic's validation errors into messages a user can act on.

Every message names the key path as written in YAML (``data.datasets[0].type``), the bad value,
what is allowed, and, for typos, the closest valid key or value.
"""

import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from hone.errors import HoneError

#: Names users bring from other tools, mapped to hone's key (searched in every section).
SYNONYMS: dict[str, str] = {
    "lr": "learning_rate",
    "batch_size": "micro_batch_size",
    "epochs": "num_epochs",
    "r": "lora_r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "target_modules": "lora_target_modules",
    "max_seq_length": "sequence_len",
    "max_length": "sequence_len",
    "seq_len": "sequence_len",
    "grad_accum": "gradient_accumulation_steps",
    "base_model": "path",
    "resume_from_checkpoint": "resume",
    "optimizer": "name",
    "peft_use_rslora": "use_rslora",
    "gradient_clipping": "max_grad_norm",
    "val_datasets": "test_datasets",
    "eval_datasets": "test_datasets",
    "dataset_processes": "num_proc",
}


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config: where it is and what is wrong."""

    path: str
    message: str
    line: int | None = None
    from_override: bool = False

    def render(self, source: str | None = None) -> str:
        where = f"{source}:{self.line}: " if source and self.line else ""
        if self.line is None and self.from_override:
            where = "--set "
        key = f"{self.path}: " if self.path else ""
        return f"{where}{key}{self.message}"


class ConfigError(HoneError):
    """All problems found in a config at once (never just the first one)."""

    def __init__(self, issues: list[ConfigIssue], source: str | None = None, *, preface: str | None = None) -> None:
        self.issues = issues
        self.source = source
        self.preface = preface
        """A paragraph that says what is wrong as a whole (an Axolotl config): printed first,
        with only the first few issues after it."""
        super().__init__(self.render())

    def render(self) -> str:
        count = len(self.issues)
        if self.preface is not None:  # the issues that suggest a hone key say the most
            shown = sorted(self.issues, key=lambda i: "did you mean" not in i.message)[:PREFACE_ISSUES]
            head = f"{self.source or 'config'}: {self.preface}\n{len(shown)} of its {count} problems as a hone config:"
            return "\n".join([head, *(f"  - {i.render(self.source)}" for i in shown)])
        head = f"{self.source or 'config'}: {count} problem{'s' if count != 1 else ''}"
        return "\n".join([head, *(f"  - {i.render(self.source)}" for i in self.issues)])


#: How many issues follow a preface (the rest are the same mistake again).
PREFACE_ISSUES = 3

#: Top-level keys of Axolotl configs that hone keeps in sections (``base_model`` is
#: ``model.path``, ``micro_batch_size`` is ``training.micro_batch_size``, ...).
AXOLOTL_KEYS = frozenset(
    "base_model base_model_config model_type tokenizer_type load_in_8bit load_in_4bit datasets dataset_prepared_path "
    "val_set_size sequence_len sample_packing pad_to_sequence_len lora_r lora_alpha lora_dropout lora_target_modules "
    "lora_target_linear micro_batch_size gradient_accumulation_steps num_epochs max_steps learning_rate lr_scheduler "
    "warmup_steps warmup_ratio weight_decay bf16 fp16 tf32 flash_attention gradient_checkpointing output_dir "
    "chat_template special_tokens wandb_project saves_per_epoch evals_per_epoch train_on_inputs".split()
)


def axolotl_preface(raw: dict[str, Any], source: str, root: type[BaseModel]) -> str | None:
    """The paragraph for a config written for Axolotl (at least 3 of its well-known keys at the
    top level, where hone has sections): convert it rather than fix it key by key."""
    found = [key for key in raw if key in AXOLOTL_KEYS and key not in root.model_fields]
    if len(found) < 3:
        return None
    shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
    out = Path(source).with_suffix(".hone.yml")
    return (
        f"this looks like an Axolotl config ({shown} at the top level; hone groups its keys in sections: "
        f"model, data, adapter, training, optimizer, ...). Convert it with\n"
        f"  hone convert {source} -o {out}\n"
        f"which lists every key it cannot translate, then check the result with `hone validate {out}` "
        "(docs/convert.md)."
    )


def format_path(loc: tuple[Any, ...]) -> str:
    """``('data', 'datasets', 0, 'type')`` -> ``data.datasets[0].type``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


# ---------------------------------------------------------------- walking the schema


def _unwrap(annotation: Any) -> list[Any]:
    """The concrete alternatives inside Optional / Annotated / Union annotations."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [alt for arg in typing.get_args(annotation) for alt in _unwrap(arg)]
    return [annotation]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    found = []
    for alt in _unwrap(annotation):
        if isinstance(alt, type) and issubclass(alt, BaseModel):
            found.append(alt)
        elif typing.get_origin(alt) in (list, dict):
            found.extend(_models_in(typing.get_args(alt)[-1]))
    return found


def _tag_of(model: type[BaseModel]) -> str | None:
    field = model.model_fields.get("type")
    if field is None or typing.get_origin(field.annotation) is not typing.Literal:
        return None
    return typing.get_args(field.annotation)[0]


def clean_location(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[type[BaseModel]]]:
    """Drop pydantic's internal loc parts (union tags, type names) and return the models that
    can hold the last key, so suggestions can be drawn from their fields."""
    models: list[type[BaseModel]] = [root]
    clean: list[Any] = []
    for part in loc:
        if isinstance(part, int):
            clean.append(part)
            continue
        tagged = [m for m in models if _tag_of(m) == part]
        if tagged and len(models) > 1:
            models = tagged
            continue
        holders = [m for m in models if part in m.model_fields]
        if not holders:
            if models and any(part == _tag_of(m) for m in models):
                continue
            if clean and not isinstance(part, str):
                continue
            if "[" in str(part) or part in ("str", "int", "float", "bool", "function-after", "function-before"):
                continue  # a union branch name such as 'list[str]' or "literal['all-linear']"
            clean.append(part)
            models = []
            continue
        clean.append(part)
        models = [m for h in holders for m in _models_in(h.model_fields[part].annotation)]
    return tuple(clean), models


def all_keys(root: type[BaseModel], prefix: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], str]]:
    """Every (parent path, key) pair of the schema, for cross-section suggestions."""
    keys = []
    for name, field in root.model_fields.items():
        keys.append((prefix, name))
        for sub in _models_in(field.annotation):
            keys.extend(all_keys(sub, (*prefix, name)))
    return keys


def suggest_key(root: type[BaseModel], parent: tuple[Any, ...], siblings: list[type[BaseModel]], key: str) -> str | None:
    """The key the user most likely meant, as a full path, or None."""
    names = sorted({n for m in siblings for n in m.model_fields})
    wanted = SYNONYMS.get(key, key)
    if wanted in names:
        return format_path((*parent, wanted))
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    if close:
        return format_path((*parent, close[0]))
    # Elsewhere in the schema (e.g. an Axolotl-style flat key such as `sequence_len`).
    elsewhere = [(p, n) for p, n in all_keys(root) if n == wanted]
    if not elsewhere:
        elsewhere = [(p, n) for p, n in all_keys(root) if difflib.get_close_matches(wanted, [n], cutoff=0.85)]
    if elsewhere:
        p, n = elsewhere[0]
        return format_path((*p, n)).replace(".datasets.", ".datasets[i].")
    return None


def _all_models(root: type[BaseModel]) -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []
    stack = [root]
    while stack:
        model = stack.pop()
        if model in seen:
            continue
        seen.append(model)
        for field in model.model_fields.values():
            stack.extend(_models_in(field.annotation))
    return seen


def other_variant_message(root: type[BaseModel], holders: list[type[BaseModel]], key: str) -> str | None:
    """For a key that belongs to another ``type`` of a tagged section (``field_messages`` on an
    ``alpaca`` dataset): which type it belongs to, instead of the same key back as a typo fix."""
    tags = [t for t in (_tag_of(m) for m in holders) if t is not None]
    if len(tags) != 1:
        return None
    base = [b for b in holders[0].__mro__[1:] if isinstance(b, type) and issubclass(b, BaseModel) and b is not BaseModel]
    owners = [
        tag
        for model in _all_models(root)
        if (tag := _tag_of(model)) is not None
        and tag != tags[0]
        and key in model.model_fields
        and any(issubclass(model, b) for b in base[:1])
    ]
    if not owners:
        return None
    kinds = " or ".join(f"'{t}'" for t in sorted(owners))
    return (
        f"unknown key for type '{tags[0]}': '{key}' belongs to type {kinds}; remove it, or set "
        f"type: {sorted(owners)[0]} if that is the format of the data"
    )


# ---------------------------------------------------------------- messages

_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "string": "a string",
    "list": "a list",
    "dict": "a mapping",
    "model": "a mapping of keys",
    "path": "a path",
}


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _expected_values(ctx: dict[str, Any]) -> list[str]:
    raw = ctx.get("expected") or ctx.get("expected_tags") or ""
    return [v.strip().strip("'") for v in raw.replace(" or ", ", ").split(",") if v.strip()]


#: Values other tools use for what hone spells differently (Axolotl's dataset types among them).
_KNOWN_SPELLINGS = {"sharegpt": "chat", "chat_template": "chat", "messages": "chat", "conversation": "chat", "text": "completion"}


def closest_value(bad: str, allowed: list[str]) -> str | None:
    """The allowed value ``bad`` most likely meant: another tool's spelling of it, a close
    spelling, or one that ``bad`` starts with (``chat_template`` -> ``chat``)."""
    lowered = bad.strip().lower()
    for spelling in (lowered, lowered.split(":")[0]):
        if _KNOWN_SPELLINGS.get(spelling) in allowed:
            return _KNOWN_SPELLINGS[spelling]
    close = difflib.get_close_matches(lowered, allowed, n=1, cutoff=0.5)
    if close:
        return close[0]
    starts = [value for value in allowed if len(value) >= 3 and lowered.startswith(value)]
    return max(starts, key=len) if starts else None


def describe_error(err: dict[str, Any]) -> str:
    """One pydantic error dict -> a sentence with the value and what is allowed."""
    kind: str = err["type"]
    value = err.get("input")
    ctx = err.get("ctx") or {}
    if kind in ("literal_error", "union_tag_invalid", "enum"):
        allowed = _expected_values(ctx)
        bad = ctx.get("tag", value)
        msg = f"{_show(bad)} is not one of: {', '.join(allowed)}"
        close = closest_value(str(bad), allowed)
        if close and "chat" in allowed and str(bad).strip().lower().startswith("sharegpt"):
            return msg + f" (did you mean '{close}'? ShareGPT rows are type chat with a field mapping: see docs/datasets.md)"
        return msg + (f" (did you mean '{close}'?)" if close else "")
    if kind == "union_tag_not_found":
        return f"missing key '{ctx.get('discriminator', 'type').strip(chr(39))}' that selects the format"
    if kind == "missing":
        return "required key is missing"
    if kind == "value_error":
        return err["msg"].removeprefix("Value error, ")
    for prefix, words in _TYPE_WORDS.items():
        if kind.startswith(prefix + "_") or kind == prefix:
            return f"expected {words}, got {_show(value)} ({type(value).__name__})"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "too_long"):
        return f"{err['msg'].replace('Input should', 'must').replace('Value should', 'must')}, got {_show(value)}"
    return f"{err['msg']} (got {_show(value)})"


def issues_from_validation(root: type[BaseModel], exc: ValidationError, lines: dict[tuple[Any, ...], int]) -> list[ConfigIssue]:
    """Every error of ``exc`` as a :class:`ConfigIssue`; union-branch duplicates merged."""
    grouped: dict[tuple[Any, ...], list[str]] = {}
    for err in exc.errors(include_url=False):
        loc, _ = clean_location(root, tuple(err["loc"]))
        if err["type"] == "union_tag_invalid":
            loc = (*loc, str((err.get("ctx") or {}).get("discriminator", "type")).strip("'"))
        misspelt = _misspelt_tag(root, err) if err["type"] == "union_tag_not_found" else None
        if misspelt is not None:  # `tpye: alpaca`: the typo is the mistake, not a missing `type`
            key, msg = misspelt
            loc = (*loc, key)
        elif err["type"] == "extra_forbidden":
            parent, key = loc[:-1], loc[-1]
            _, holders = clean_location(root, tuple(err["loc"][:-1]))
            msg = other_variant_message(root, holders, str(key))
            if msg is None:
                hint = suggest_key(root, parent, holders, str(key))
                msg = "unknown key" + (f" (did you mean '{hint}'?)" if hint else "")
        else:
            msg = describe_error(err)
        bucket = grouped.setdefault(loc, [])
        if msg not in bucket:
            bucket.append(msg)
    issues = []
    for loc, msgs in grouped.items():
        message = msgs[0] if len(msgs) == 1 else "matches no allowed form: " + "; or ".join(msgs)
        line = _line_for(lines, loc)
        # a key set (or a section made) by --set has no line of its own: never its parent's
        overridden = any(v <= 0 and (loc[: len(k)] == k or k[: len(loc)] == loc) for k, v in lines.items())
        if overridden and lines.get(loc, 0) <= 0:
            line = None
        issues.append(ConfigIssue(format_path(loc), message, line, overridden and line is None))
    return issues


def _misspelt_tag(root: type[BaseModel], err: dict[str, Any]) -> tuple[str, str] | None:
    """(key, message) for a key of the mapping close to its missing discriminator."""
    tag = str((err.get("ctx") or {}).get("discriminator", "type")).strip("'")
    value = err.get("input")
    if not isinstance(value, dict):
        return None
    _, holders = clean_location(root, tuple(err["loc"]))
    known = {name for model in holders for name in model.model_fields}
    unknown = [str(k) for k in value if str(k) not in known]
    close = difflib.get_close_matches(tag, unknown, n=1, cutoff=0.6)
    if not close:
        return None
    tags = sorted(t for t in (_tag_of(m) for m in holders) if t is not None)
    allowed = f": one of {', '.join(tags)}" if tags else ""
    return close[0], f"unknown key (did you mean '{tag}'? it selects the format{allowed})"


def _line_for(lines: dict[tuple[Any, ...], int], loc: tuple[Any, ...]) -> int | None:
    for cut in range(len(loc), -1, -1):
        if loc[:cut] in lines:
            line = lines[loc[:cut]]
            return line if line > 0 else None  # <= 0: the key came from --set
    return None
