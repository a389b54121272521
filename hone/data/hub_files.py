"""Data files of a Hugging Face dataset repo, read from the local hub cache.

(A bare dataset id, ``path: Org/Name``, is found by :mod:`hone.data.hub_datasets`;
:func:`with_cached_data_files` resolves both forms.)

``path: hf://datasets/Org/Name/train.jsonl`` (or ``hf://datasets/Org/Name@revision/...``, the
address huggingface_hub's file system uses) names one file of a dataset repo; hone reads it
from the cache (``HF_HUB_CACHE`` / ``HF_HOME``) with huggingface_hub's
``try_to_load_from_cache`` and never downloads it. The file suffix still picks the format, so
the config validates as for a local file. Resolved once, when the data is prepared
(:func:`with_cached_data_files`) and when the files are checked (``hone validate``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hone.config.data import SUFFIX_FORMATS
from hone.data.errors import DataError
from hone.models.hub import hub_cache_dir

if TYPE_CHECKING:
    from hone.config.root import HoneConfig

#: ``pathlib`` folds ``hf://`` to ``hf:/``: both spellings are read.
_HUB_FILE = re.compile(
    r"^hf:/{1,2}datasets/(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w.-]+))?/(?P<file>.+)$"
)


@dataclass(frozen=True)
class HubFile:
    repo_id: str
    filename: str
    revision: str | None = None

    def __str__(self) -> str:
        at = f"@{self.revision}" if self.revision else ""
        return f"hf://datasets/{self.repo_id}{at}/{self.filename}"


def parse_hub_file(path: str | Path) -> HubFile | None:
    """The dataset file ``path`` names (``hf://datasets/Org/Name[@rev]/file``), or None. Pure."""
    match = _HUB_FILE.match(str(path))
    return None if match is None else HubFile(match["repo"], match["file"], match["revision"])


def local_data_file(path: Path, key: str) -> Path:
    """``path`` itself, or the cached copy of the dataset file it names; :class:`DataError`
    when that file is not in the cache."""
    hub = parse_hub_file(path)
    if hub is None:
        return Path(path)
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(
        hub.repo_id, hub.filename, cache_dir=hub_cache_dir(), revision=hub.revision, repo_type="dataset"
    )
    if isinstance(found, str):
        return Path(found)
    revision = f" --revision {hub.revision}" if hub.revision else ""
    raise DataError(
        f"{key}: '{hub}' is not in the local Hugging Face cache ({hub_cache_dir()}, set by HF_HUB_CACHE or "
        f"HF_HOME); hone reads datasets from local files only: fetch it with `huggingface-cli download "
        f"{hub.repo_id} {hub.filename} --repo-type dataset{revision}` (or `hf download`)"
    )


def cached_entry(entry: Any, key: str) -> Any:
    """``entry`` reading local files: an ``hf://datasets/...`` path replaced by its cached file,
    a hub dataset id given the cached files of its split (:mod:`hone.data.hub_datasets`); a
    local file as it is. Raises :class:`DataError` naming ``key`` when the data is not cached."""
    from hone.data.hub_datasets import dataset_id_of, find_cached_dataset

    if parse_hub_file(entry.path) is not None:
        return entry.model_copy(update={"path": local_data_file(entry.path, f"{key}.path")})
    hub = dataset_id_of(entry.path)
    if hub is None:
        if entry.file_format == "auto" and entry.path.suffix.lower() not in SUFFIX_FORMATS:  # a local file named like an id
            raise DataError(
                f"{key}.path: cannot tell the file format of '{entry.path}' from its suffix: set {key}.file_format "
                f"to one of: {', '.join(sorted(set(SUFFIX_FORMATS.values())))}"
            )
        return entry
    found = find_cached_dataset(hub, entry.split, f"{key}.path")
    if entry.file_format != "auto" and entry.file_format != found.file_format:
        raise DataError(
            f"{key}.file_format: '{entry.file_format}' but the files of '{hub}' in {found.where} are {found.file_format}; "
            "leave file_format at auto"
        )
    return entry.with_files(found.files, found.file_format)


def with_cached_data_files(cfg: HoneConfig) -> HoneConfig:
    """``cfg`` with every ``hf://datasets/...`` entry pointing at its cached file and every hub
    dataset id given its cached files (the same config object when there is none)."""
    updates = {}
    for section in ("datasets", "test_datasets"):
        entries = getattr(cfg.data, section)
        resolved = [cached_entry(entry, f"data.{section}[{index}]") for index, entry in enumerate(entries)]
        if any(new is not old for new, old in zip(resolved, entries)):
            updates[section] = resolved
    if not updates:
        return cfg
    return cfg.model_copy(update={"data": cfg.data.model_copy(update=updates)})
