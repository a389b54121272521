"""The config a run directory records: what the run used, readable from any working directory.

hone resolves a relative path in a config against the working directory ``hone train`` runs in
(the config file's own directory plays no part). ``config.yml`` in the run directory is read back
by ``hone generate`` / ``chat`` / ``merge`` from wherever the user stands, so it records every
local path the run used as an absolute path: a relative ``model.path: ./models/tiny`` becomes
``/home/me/proj/models/tiny``. What is not a local path stays as written: a hub id
(``Org/Name``: no local path of that name exists), an ``hf://datasets/...`` file. The config the
run trains with is not changed (data cache keys and messages keep the user's spelling); only the
recorded copy is.
"""

from pathlib import Path

from hone.config.root import HoneConfig


def recorded_config(cfg: HoneConfig, cwd: Path | None = None) -> HoneConfig:
    """``cfg`` with its relative local paths made absolute against ``cwd`` (default: the
    working directory): inputs (model, tokenizer, data files) when they exist there, outputs
    (``training.output_dir``, ``data.dataset_prepared_path``, a ``training.resume`` path) always."""
    base = Path.cwd() if cwd is None else Path(cwd)
    model = cfg.model.model_copy(
        update={"path": _input(cfg.model.path, base), "tokenizer_path": _input(cfg.model.tokenizer_path, base)}
    )
    data = cfg.data.model_copy(
        update={
            "datasets": [d.model_copy(update={"path": _input(d.path, base)}) for d in cfg.data.datasets],
            "test_datasets": [d.model_copy(update={"path": _input(d.path, base)}) for d in cfg.data.test_datasets],
            "dataset_prepared_path": _output(cfg.data.dataset_prepared_path, base),
        }
    )
    resume = cfg.training.resume
    training = cfg.training.model_copy(
        update={
            "output_dir": _output(cfg.training.output_dir, base),
            "resume": _output(resume, base) if isinstance(resume, Path) else resume,
        }
    )
    return cfg.model_copy(update={"model": model, "data": data, "training": training})


def _input(path: Path | None, base: Path) -> Path | None:
    """Absolute when ``path`` is relative and exists under ``base``; else as written (a hub id,
    an ``hf://`` file, or a path that is missing and will be reported by the run itself)."""
    if path is None or path.is_absolute() or not (base / path).exists():
        return path
    return _absolute(base / path)


def _output(path: Path | None, base: Path) -> Path | None:
    if path is None or path.is_absolute():
        return path
    return _absolute(base / path)


def _absolute(path: Path) -> Path:
    """Absolute and without ``.`` / ``..`` parts, symlinks kept (the user's names, not their targets)."""
    import os

    return Path(os.path.normpath(path.absolute()))
