"""Read a YAML config, apply ``--set`` overrides and validate it into a :class:`HoneConfig`."""

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hone.config.errors import ConfigError, ConfigIssue, axolotl_preface, format_path, issues_from_validation
from hone.config.root import HoneConfig

Lines = dict[tuple[Any, ...], int]

#: Line marker for keys that came from ``--set`` (they have no line in the file).
OVERRIDDEN = -1


def _read_yaml(text: str, source: str) -> tuple[Any, Lines]:
    """Parse YAML, refusing duplicate keys, and remember the line of every key."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([ConfigIssue("", f"malformed YAML: {problem}", line)], source) from None
    if node is None:
        return {}, {}
    lines: Lines = {}
    issues: list[ConfigIssue] = []
    _collect_lines(node, (), lines, issues)
    if issues:
        raise ConfigError(issues, source)
    return yaml.safe_load(text), lines


def _collect_lines(node: yaml.Node, path: tuple[Any, ...], lines: Lines, issues: list[ConfigIssue]) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            line = key_node.start_mark.line + 1
            if key in seen:
                issues.append(ConfigIssue(format_path((*path, key)), f"duplicate key (first set on line {seen[key]})", line))
            seen[key] = line
            _collect_lines(value_node, (*path, key), lines, issues)
            lines[(*path, key)] = line
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _collect_lines(item, (*path, index), lines, issues)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides (values parsed as YAML) to a copy of ``raw``.

    List elements are addressed by index: ``data.datasets.0.path=x.jsonl``.
    """
    import copy

    data = copy.deepcopy(raw)
    issues = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            issues.append(ConfigIssue(item, "override must look like key.path=value (e.g. optimizer.learning_rate=2e-4)"))
            continue
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            issues.append(ConfigIssue(key.strip(), f"the value {text!r} is not valid YAML ({problem}); quote it or fix it"))
            continue
        parts: list[Any] = [int(p) if p.isdigit() else p for p in key.strip().split(".")]
        target: Any = data
        for depth, part in enumerate(parts[:-1]):
            if isinstance(target, list):
                if not isinstance(part, int) or part >= len(target):
                    issues.append(ConfigIssue(format_path(tuple(parts[: depth + 1])), f"no list element {part} to override"))
                    break
                target = target[part]
            else:
                target = target.setdefault(part, {})
                if not isinstance(target, (dict, list)):
                    issues.append(
                        ConfigIssue(format_path(tuple(parts[: depth + 1])), "is not a section, cannot set a key inside it")
                    )
                    break
        else:
            last = parts[-1]
            if isinstance(target, list):
                if not isinstance(last, int) or last >= len(target):
                    issues.append(ConfigIssue(key, f"no list element {last} to override"))
                    continue
            target[last] = value
    if issues:
        raise ConfigError(issues, "--set")
    return data


def parse_config(raw: Any, source: str = "config", lines: Lines | None = None) -> HoneConfig:
    """Validate an already-parsed mapping; every problem is reported in one :class:`ConfigError`."""
    if not isinstance(raw, dict):
        raise ConfigError([ConfigIssue("", f"the top level must be a mapping of sections, got {type(raw).__name__}")], source)
    try:
        return HoneConfig.model_validate(raw)
    except ValidationError as exc:
        issues = issues_from_validation(HoneConfig, exc, lines or {})
        raise ConfigError(issues, source, preface=axolotl_preface(raw, source, HoneConfig)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> HoneConfig:
    """Read ``path`` (YAML), apply overrides, validate. Raises :class:`ConfigError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([ConfigIssue("", f"config file not found: {path}")], str(path)) from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigIssue("", f"cannot read config file: {exc}")], str(path)) from None
    raw, lines = _read_yaml(text, str(path))
    if raw is None:
        raw = {}
    if overrides:
        if not isinstance(raw, dict):
            raise ConfigError([ConfigIssue("", "the top level must be a mapping of sections")], str(path))
        raw = apply_overrides(raw, overrides)
        overridden = [tuple(int(p) if p.isdigit() else p for p in o.partition("=")[0].strip().split(".")) for o in overrides]
        lines = {k: v for k, v in lines.items() if not any(k[: len(o)] == o for o in overridden)}
        lines.update({o: OVERRIDDEN for o in overridden})
    return parse_config(raw, str(path), lines)


def mark_overridden(issues: list[ConfigIssue], overrides: list[str]) -> list[ConfigIssue]:
    """``issues`` (of the checks after the schema, which have no line) with those about a key
    that an override set marked as coming from ``--set``."""
    from dataclasses import replace

    keys = {format_path(tuple(int(p) if p.isdigit() else p for p in o.partition("=")[0].strip().split("."))) for o in overrides}
    return [replace(i, from_override=True) if i.line is None and i.path in keys else i for i in issues]


def dump_config(cfg: HoneConfig) -> str:
    """The resolved config (every default filled in) as YAML, for run directories and logs."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
