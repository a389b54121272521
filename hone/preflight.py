"""Checks that need the file system but load nothing: the files the config names, the model
directory's metadata, the run directory, and the sequence length against the model.

Kept apart from the schema so validators stay pure; run by ``hone validate``, ``preprocess``
and ``train`` before any model or dataset is loaded, so a broken model directory or an
unwritable ``output_dir`` is reported before the data is tokenized. Model checks read only
metadata (``config.json``, file names, safetensors headers): see
:mod:`hone.models.model_dir`, imported lazily (this module sits above hone.config and hone.models).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hone.config.errors import ConfigIssue
from hone.config.root import HoneConfig


@dataclass
class PreflightResult:
    issues: list[ConfigIssue] = field(default_factory=list)
    """Problems that stop the command (exit 2)."""
    warnings: list[str] = field(default_factory=list)
    """Things the user opted into that may cost quality, printed and then carried on."""


def preflight(cfg: HoneConfig, *, output_dir: bool = True, weights: bool = True) -> list[ConfigIssue]:
    """Every problem the file system shows in ``cfg`` (see :func:`run_preflight`)."""
    return run_preflight(cfg, output_dir=output_dir, weights=weights).issues


def run_preflight(
    cfg: HoneConfig, *, output_dir: bool = True, weights: bool = True, build_preset: bool = True
) -> PreflightResult:
    """Files, model directory, tokenizer, run directory and sequence length, all at once.

    ``output_dir=False`` skips the run-directory and tracker checks (``hone preprocess`` writes no run);
    ``weights=False`` the model's weight and tokenizer files (``hone plan`` reads the config alone);
    ``build_preset=False`` checks a preset's overrides without building its transformers config,
    which imports torch (seconds): ``hone validate``, which loads nothing.
    """
    result = PreflightResult()
    result.issues += _path_issues(cfg)
    if output_dir:  # the commands that start a run (validate, train): its directory, its trackers
        result.issues += objective_issues(cfg)
        result.issues += _output_dir_issues(cfg)
        _tracker_check(cfg, result)
    model_config = _model_issues(cfg, result, weights, build_preset)
    _context_check(cfg, model_config, result)
    return result


#: Objectives that train on preference pairs (issue 28); ``sft`` trains the language-modelling loss.
PREFERENCE_OBJECTIVES = ("dpo", "ipo", "orpo")


def objective_issues(cfg: HoneConfig) -> list[ConfigIssue]:
    """Preference pairs need a preference objective and SFT rows the language-modelling loss.

    Checked for the commands that train (validate, train), not for ``hone preprocess``,
    which prepares and checks pairs whatever the objective.
    """
    name = cfg.training.objective
    if cfg.data.is_preference and name not in PREFERENCE_OBJECTIVES:
        return [
            ConfigIssue(
                "data.datasets.0.type",
                f"preference needs a preference objective (training.objective: {' | '.join(PREFERENCE_OBJECTIVES)}), but "
                f"training.objective is '{name}' (the language-modelling loss on rows)",
            )
        ]
    if not cfg.data.is_preference and name in PREFERENCE_OBJECTIVES:
        return [
            ConfigIssue(
                "training.objective",
                f"'{name}' trains on preference pairs, but data.datasets.0.type is {cfg.data.datasets[0].type}: "
                "it needs datasets of type preference (prompt, chosen, rejected)",
            )
        ]
    return []


def _path_issues(cfg: HoneConfig) -> list[ConfigIssue]:
    from hone.data.errors import DataError
    from hone.data.hub_files import cached_entry
    from hone.paths import readable_file_problem

    issues: list[ConfigIssue] = []
    for section in ("datasets", "test_datasets"):
        for index, dataset in enumerate(getattr(cfg.data, section)):
            key = f"data.{section}[{index}].path"
            try:  # hf://datasets/... and hub dataset ids: their cached files
                files = cached_entry(dataset, f"data.{section}[{index}]").files
            except DataError as exc:
                where, _, message = str(exc).partition(": ")
                issues.append(ConfigIssue(where if where.startswith("data.") else key, message or str(exc)))
                continue
            for path in files:
                if not path.exists():
                    issues.append(ConfigIssue(key, f"data file not found: '{path}' (relative paths are from {Path.cwd()})"))
                elif (problem := readable_file_problem(path)) is not None:
                    issues.append(ConfigIssue(key, problem))
    prepared = cfg.data.dataset_prepared_path
    if prepared is not None and prepared.exists() and not prepared.is_dir():
        issues.append(
            ConfigIssue("data.dataset_prepared_path", f"'{prepared}' is a file; the prepared-data cache must be a directory")
        )
    resume = cfg.training.resume
    if isinstance(resume, Path) and not resume.is_dir():
        what = "is a file, not a checkpoint directory" if resume.exists() else "not found"
        issues.append(ConfigIssue("training.resume", f"checkpoint directory {what}: '{resume}'"))
    return issues


def _output_dir_issues(cfg: HoneConfig) -> list[ConfigIssue]:
    from hone.paths import output_dir_problem

    problem = output_dir_problem(cfg.training.output_dir)
    return [] if problem is None else [ConfigIssue("training.output_dir", problem)]


def _model_issues(cfg: HoneConfig, result: PreflightResult, weights: bool = True, build_preset: bool = True) -> Any:
    """Model directory (or preset) and tokenizer problems; returns the model config if readable."""
    from hone.models.errors import ModelError
    from hone.models.tokenizer import tokenizer_dir_problems

    model = cfg.model
    config: Any = None
    downloading = _pending_downloads(cfg, result)
    if model.path is not None:
        config = None if "model.path" in downloading else _model_dir_issues(cfg, result, weights)
        if config is _MISSING:
            return None  # the tokenizer would be looked for in the same missing place
    else:
        from hone.models.presets import build_preset_config, preset_values

        try:
            if build_preset:
                config = build_preset_config(model.preset, dict(model.preset_overrides), None)
            else:  # its values: what the sequence-length check reads
                config = preset_values(model.preset, dict(model.preset_overrides))
        except ModelError as exc:
            key, _, message = str(exc).partition(": ")
            result.issues.append(ConfigIssue(key if key.startswith("model.") else "model.preset", message or str(exc)))
    config = _with_rope_scaling(model, config, result)
    key = "model.tokenizer_path" if model.tokenizer_path is not None else "model.path"
    if weights and (model.tokenizer_path is not None or model.path is not None) and key not in downloading:
        result.issues += [ConfigIssue(key, p) for p in tokenizer_dir_problems(model)]
    return config


_MISSING = object()


def _with_rope_scaling(model: Any, config: Any, result: PreflightResult) -> Any:
    """The model's config as the loader will build it: with ``model.rope_scaling`` applied, so
    the sequence-length check reads the scaled positions."""
    if config is None or model.rope_scaling is None:
        return config
    from hone.models.errors import ModelError
    from hone.models.rope_scaling import with_rope_scaling

    try:
        return with_rope_scaling(config, model.rope_scaling)
    except ModelError as exc:
        result.issues.append(ConfigIssue("model.rope_scaling", str(exc).removeprefix("model.rope_scaling: ")))
        return None


def _model_dir_issues(cfg: HoneConfig, result: PreflightResult, weights: bool) -> Any:
    """``model.path`` (a directory or a cached hub id): its problems, and its config when
    readable; ``_MISSING`` when it is not there and the tokenizer would share its fate."""
    from hone.models.hub import HubModelNotFound, hub_id_of, local_model_dir

    model = cfg.model
    try:
        path = local_model_dir(model.path)  # a hub id: its cached snapshot
    except HubModelNotFound as exc:
        result.issues.append(ConfigIssue("model.path", str(exc).removeprefix("model.path: ")))
        return _MISSING if model.tokenizer_path is None else None
    config: Any = None
    if not path.is_dir():
        if path.exists():
            message = f"'{path}' is a file; it must be a model directory written by save_pretrained"
        else:
            message = f"model directory not found: '{path}' (relative paths are from {Path.cwd()})"
        result.issues.append(ConfigIssue("model.path", message))
        if model.tokenizer_path is None:
            return _MISSING
    else:
        from hone.models.model_dir import model_dir_problems

        problems, config = model_dir_problems(path, model.trust_remote_code, weights=weights)
        if hub_id_of(model.path) is not None:  # say which id the snapshot belongs to
            problems = [f"{p.removeprefix('model.path: ')} (the cached snapshot of '{model.path}')" for p in problems]
        result.issues += [ConfigIssue("model.path", p.removeprefix("model.path: ")) for p in problems]
    return config


def _pending_downloads(cfg: HoneConfig, result: PreflightResult) -> set[str]:
    """Keys whose hub id is not cached but will be downloaded by ``hone train``
    (``model.allow_download: true``): noted as warnings, their checks wait for the files."""
    if not cfg.model.allow_download:
        return set()
    from hone.models.hub import cached_snapshot, hub_cache_dir, hub_id_of

    pending = set()
    for key, value in (("model.path", cfg.model.path), ("model.tokenizer_path", cfg.model.tokenizer_path)):
        hub = hub_id_of(value) if value is not None else None
        if hub is not None and cached_snapshot(hub) is None:
            pending.add(key)
            result.warnings.append(
                f"{key}: '{hub}' is not in the local hub cache ({hub_cache_dir()}); `hone train` will download "
                "its safetensors, config and tokenizer files (model.allow_download: true)"
            )
    return pending


def _tracker_check(cfg: HoneConfig, result: PreflightResult) -> None:
    """Trackers that could not start (package missing, no W&B login, ...): issues, or warnings
    under ``logging.tracker_errors: warn``. Starts nothing."""
    from hone.track.trackers import tracker_problems

    for key, problem in tracker_problems(cfg):
        if cfg.logging.tracker_errors == "warn":
            result.warnings.append(f"{key}: {problem}; training without it (logging.tracker_errors: warn)")
        else:
            result.issues.append(ConfigIssue(key, problem))


def _context_check(cfg: HoneConfig, config: Any, result: PreflightResult) -> None:
    """``data.sequence_len`` against the positions the model was built for."""
    if config is None:
        return
    from hone.models.model_dir import context_length, rope_scaling_type

    limit = context_length(config)
    wanted = cfg.data.sequence_len
    if limit is None or wanted <= limit:
        return
    what = (
        f"data.sequence_len {wanted} is longer than the {limit} positions the model was built for "
        f"(max_position_embeddings of {cfg.model.source})"
    )
    scaling = rope_scaling_type(config)
    if cfg.model.rope_scaling is not None and not cfg.data.allow_longer_than_model:
        factor = cfg.model.rope_scaling.factor
        result.issues.append(
            ConfigIssue(
                "data.sequence_len",
                f"{wanted} is longer than the {limit} positions model.rope_scaling gives "
                f"({cfg.model.rope_scaling.type}, factor {factor:g}): raise model.rope_scaling.factor to at least "
                f"{factor * wanted / limit:g}, set data.sequence_len to at most {limit}, or set "
                "data.allow_longer_than_model: true to train anyway",
            )
        )
    elif scaling is not None:
        result.warnings.append(f"{what}; its config sets RoPE scaling '{scaling}', which is meant to stretch them")
    elif cfg.data.allow_longer_than_model:
        result.warnings.append(
            f"{what}; training anyway (data.allow_longer_than_model: true): positions past {limit} are "
            "extrapolated and quality may drop"
        )
    else:
        result.issues.append(
            ConfigIssue(
                "data.sequence_len",
                f"{wanted} is longer than the {limit} positions the model was built for "
                f"(max_position_embeddings of {cfg.model.source}) and its config sets no RoPE scaling: "
                f"set data.sequence_len to at most {limit}, extend the positions with "
                f"model.rope_scaling (e.g. {{type: yarn, factor: {-(-wanted // limit)}}}; docs/long-context.md), "
                "pick a model with a longer context, or set "
                "data.allow_longer_than_model: true to train anyway (quality past the model's range may drop)",
            )
        )
