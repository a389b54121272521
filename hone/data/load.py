"""Read one local data file into a ``datasets.Dataset``.

Every format goes through HF ``datasets``' packaged builders (``json`` for jsonl and json,
``parquet``, ``csv``, ``arrow``), so hone reads exactly what ``datasets`` users expect. The
builders' own Arrow cache goes into a scratch directory that the caller owns and deletes (the
prepared, tokenized dataset is what hone caches), so nothing lands in ``~/.cache/huggingface``.

``datasets``' errors are wrapped in :class:`DataError` naming the file, and for JSON Lines the
first line that does not parse, found by re-reading the file only after a failure (the happy
path stays one pass).
"""

from __future__ import annotations

import glob
import json
from collections.abc import Sequence
from pathlib import Path

import datasets

from hone.config.data import SUFFIX_FORMATS
from hone.data.errors import DataError

#: hone's file format -> ``datasets`` packaged builder.
BUILDERS: dict[str, str] = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv", "arrow": "arrow"}

#: Builder options. ``parse_agent_traces=False``: the json builder would otherwise rewrite
#: rows that look like agent traces (a ``messages`` column among others) into its own schema.
_BUILDER_KWARGS: dict[str, dict[str, object]] = {"json": {"parse_agent_traces": False}}


def load_file(paths: Path | Sequence[Path], file_format: str, scratch: Path, key: str) -> datasets.Dataset:
    """All rows of ``paths`` (one file, or the files of a hub dataset's split, in order), in
    format ``file_format`` (already resolved from ``auto``).

    ``scratch`` receives ``datasets``' intermediate Arrow files; ``key`` is the config key of
    the dataset entry (``data.datasets[0]``), used in messages.
    """
    files = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    for path in files:
        check_file(path, key)
    path = files[0] if len(files) == 1 else files[0].parent
    builder = BUILDERS[file_format]
    try:
        dataset = datasets.load_dataset(
            builder,
            data_files=[glob.escape(str(f.resolve())) for f in files],  # literal paths, never patterns
            split="train",
            cache_dir=str(scratch),
            **_BUILDER_KWARGS.get(builder, {}),
        )
    except Exception as exc:  # datasets raises many types; every one here means "this file"
        raise DataError(_describe_failure(files[0] if len(files) == 1 else path, file_format, exc, key)) from exc
    if len(dataset) == 0:
        raise DataError(f"{path}: the file has no rows ({key}); add data or remove it from the config")
    return dataset


def check_file(path: Path, key: str) -> None:
    """Fail early, naming the config key, for a missing, non-regular or empty file."""
    if not path.exists():
        raise DataError(f"data file not found: '{path}' ({key}.path; relative paths are from {Path.cwd()})")
    if not path.is_file():
        raise DataError(f"'{path}' is not a file ({key}.path): point it at one data file")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty ({key}); add data or remove it from the config")


def _describe_failure(path: Path, file_format: str, exc: BaseException, key: str) -> str:
    """The most precise message we can give for a file that ``datasets`` could not read."""
    if file_format == "jsonl":
        located = _first_bad_jsonl_line(path)
        if located is not None:
            return f"{path} line {located}: malformed JSON Lines file ({key}); every line must be one JSON object"
    elif file_format == "json":
        located = _json_syntax_error(path)
        if located is not None:
            return f"{path} {located}: malformed JSON file ({key})"
    cause = _root_cause(exc)
    if isinstance(exc, StopIteration) or _is_blank(path) or "corresponds to no data" in str(cause):
        # StopIteration: json builder on a file without records; the other: csv with only a header.
        return f"{path}: the file has no rows ({key}); add data or remove it from the config"
    suffix_format = SUFFIX_FORMATS.get(path.suffix.lower())
    hint = ""
    if suffix_format is not None and suffix_format != file_format:
        hint = f"; the file_format is '{file_format}' but the suffix says '{suffix_format}'"
    return f"{path}: cannot read it as {file_format} ({key}): {type(cause).__name__}: {cause}{hint}"


def _root_cause(exc: BaseException) -> BaseException:
    """``datasets`` wraps the real error (e.g. pyarrow's) in ``DatasetGenerationError``."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def _first_bad_jsonl_line(path: Path) -> str | None:
    """``'7 (Expecting ',' delimiter ...)'`` for the first line that is not a JSON object."""
    try:
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                line = raw.strip()
                if not line:
                    continue
                try:
                    value = json.loads(line)
                except UnicodeDecodeError:
                    return f"{number} (not valid UTF-8)"
                except ValueError as err:
                    return f"{number} ({getattr(err, 'msg', err)} at column {getattr(err, 'colno', '?')})"
                if not isinstance(value, dict):
                    return f"{number} (a JSON {type(value).__name__}, not an object)"
    except OSError:
        return None
    return None


def _json_syntax_error(path: Path) -> str | None:
    try:
        json.loads(path.read_bytes())
    except UnicodeDecodeError:
        return "(not valid UTF-8)"
    except ValueError as err:
        return f"line {getattr(err, 'lineno', '?')} column {getattr(err, 'colno', '?')} ({getattr(err, 'msg', err)})"
    except OSError:
        return None
    return None


def _is_blank(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return not f.read(1 << 16).strip()
    except OSError:
        return False
