"""Checks that need the file system but nothing heavy: do the files the config names exist?

Kept apart from the schema so validators stay pure; run by ``hone validate``, ``preprocess`` and
``train`` before any model or dataset is loaded.
"""

from pathlib import Path

from hone.config.errors import ConfigIssue
from hone.config.root import HoneConfig


def preflight(cfg: HoneConfig) -> list[ConfigIssue]:
    """Every missing file or directory the config refers to."""
    issues: list[ConfigIssue] = []
    if cfg.model.path is not None and not cfg.model.path.is_dir():
        issues.append(ConfigIssue("model.path", f"model directory not found: '{cfg.model.path}' (relative paths are from {Path.cwd()})"))
    if cfg.model.tokenizer_path is not None and not cfg.model.tokenizer_path.is_dir():
        issues.append(ConfigIssue("model.tokenizer_path", f"tokenizer directory not found: '{cfg.model.tokenizer_path}'"))
    for section in ("datasets", "test_datasets"):
        for index, dataset in enumerate(getattr(cfg.data, section)):
            if not dataset.path.exists():
                issues.append(
                    ConfigIssue(f"data.{section}[{index}].path", f"data file not found: '{dataset.path}' (relative paths are from {Path.cwd()})")
                )
    resume = cfg.training.resume
    if isinstance(resume, Path) and not resume.is_dir():
        issues.append(ConfigIssue("training.resume", f"checkpoint directory not found: '{resume}'"))
    return issues
