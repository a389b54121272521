"""Dataset ids (``path: tatsu-lab/alpaca``) resolved to data files in the local caches.

The id form is what Axolotl and ``datasets.load_dataset`` users write. hone never downloads
data; it reads what is already on disk, in the order the libraries that wrote it would:

1. the hub cache (``HF_HUB_CACHE`` / ``HF_HOME``, where ``huggingface-cli download --repo-type
   dataset`` and ``hf download`` put a repo): the snapshot is found with huggingface_hub's own
   lookup (``snapshot_download(..., local_files_only=True)``) and its files of the split with
   ``datasets``' own data-file patterns (``train.jsonl``, ``data/train-00000-of-00002.parquet``,
   ``train/*.json``, ... or every data file when nothing names a split, which is the train split);
2. the ``datasets`` Arrow cache (``HF_DATASETS_CACHE``, else ``HF_HOME/datasets``, where
   ``load_dataset`` keeps what it prepared): ``<owner>___<name>/<config>/<version>/<hash>/<name>-<split>*.arrow``.

The split is the dataset entry's ``split`` (default ``train``). An id that is in neither cache
is a :class:`DataError` that names the key, the id, where hone looked, and the command that
fetches it. A value is an id only when no local path of that name exists, it has the shape
``owner/name[@revision]`` and no data-file suffix (see :func:`hone.config.data.looks_like_hub_id`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hone.config.data import SUFFIX_FORMATS, looks_like_hub_id
from hone.data.errors import DataError
from hone.models.hub import HubId, cached_snapshot, hub_cache_dir, parse_hub_id

#: Metadata files that ``datasets`` writes beside data and that are never rows.
_NOT_DATA = {"dataset_infos.json", "dataset_info.json", "dataset_dict.json", "state.json"}


@dataclass(frozen=True)
class CachedDataset:
    """The files of one split of a dataset id, their format and where they were found."""

    files: tuple[Path, ...]
    file_format: str
    where: str


def dataset_id_of(path: str | Path) -> HubId | None:
    """The dataset id ``path`` means, or None for a local path (one that exists, or has a data-file suffix)."""
    if not looks_like_hub_id(path) or Path(path).exists():
        return None
    return parse_hub_id(path)


def datasets_cache_dir() -> Path:
    """``datasets``' Arrow cache, read from the environment now (as :func:`hub_cache_dir`)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "datasets"
    return Path.home() / ".cache" / "huggingface" / "datasets"


def find_cached_dataset(hub: HubId, split: str | None, key: str) -> CachedDataset:
    """The files of ``split`` (default train) of ``hub``; :class:`DataError` when neither cache has them."""
    split = split or "train"
    snapshot = cached_snapshot(hub, repo_type="dataset")
    if snapshot is not None:
        return _snapshot_split(hub, snapshot, split, key)
    arrow = _arrow_cache_split(hub, split, key)
    if arrow is not None:
        return arrow
    revision = f" --revision {hub.revision}" if hub.revision else ""
    raise DataError(
        f"{key}: '{hub}' is neither a local data file nor a dataset in the local caches (hub cache "
        f"{hub_cache_dir()}, set by HF_HUB_CACHE or HF_HOME; datasets cache {datasets_cache_dir()}, set by "
        f"HF_DATASETS_CACHE); hone reads data from local files only: fetch it with "
        f"`huggingface-cli download --repo-type dataset {hub.repo_id}{revision}` (or `hf download {hub.repo_id} "
        "--repo-type dataset`), or point the path at a local file (see docs/datasets.md)"
    )


def _snapshot_split(hub: HubId, snapshot: Path, split: str, key: str) -> CachedDataset:
    """The data files of ``split`` in a snapshot, by ``datasets``' own split patterns."""
    from datasets.data_files import get_data_patterns, resolve_pattern

    try:
        patterns = {str(name): value for name, value in get_data_patterns(str(snapshot)).items()}
    except FileNotFoundError:  # datasets' EmptyDatasetError and DataFilesNotFoundError: no data file
        patterns = {}
    where = f"the hub cache ({snapshot})"
    if split not in patterns:
        found = ", ".join(sorted(patterns)) or "none"
        raise DataError(f"{key}: '{hub}' in {where} has no split '{split}' (its splits: {found}); set split: to one of them")
    files = sorted(
        {Path(f) for pattern in patterns[split] for f in resolve_pattern(pattern, str(snapshot)) if _is_data_file(Path(f))}
    )
    return _one_format(hub, files, where, split, key)


def _arrow_cache_split(hub: HubId, split: str, key: str) -> CachedDataset | None:
    """The Arrow files ``load_dataset`` left for ``split``, in its newest prepared version (or None)."""
    owner, name = hub.repo_id.split("/")
    root = datasets_cache_dir() / f"{owner}___{name}"
    if not root.is_dir():
        return None
    found: dict[Path, list[Path]] = {}
    for pattern in (f"*/*/*/{name}-{split}.arrow", f"*/*/*/{name}-{split}-*-of-*.arrow"):
        for file in root.glob(pattern):
            found.setdefault(file.parent, []).append(file)
    if not found:
        splits = sorted({f.stem.removeprefix(f"{name}-").split("-")[0] for f in root.glob(f"*/*/*/{name}-*.arrow")})
        raise DataError(
            f"{key}: '{hub}' in the datasets cache ({root}) has no split '{split}' (its splits: {', '.join(splits) or 'none'})"
        )
    configs = {folder.parent.parent.name for folder in found}
    if len(configs) > 1 and "default" not in configs:
        raise DataError(
            f"{key}: '{hub}' in the datasets cache ({root}) has several configurations ({', '.join(sorted(configs))}); "
            "point the path at the Arrow file of the one to use"
        )
    folders = [f for f in found if len(configs) == 1 or f.parent.parent.name == "default"]
    newest = max(folders, key=lambda folder: folder.stat().st_mtime)
    return CachedDataset(tuple(sorted(found[newest])), "arrow", f"the datasets cache ({newest})")


def _is_data_file(path: Path) -> bool:
    return path.suffix.lower() in SUFFIX_FORMATS and path.name not in _NOT_DATA and path.is_file()


def _one_format(hub: HubId, files: list[Path], where: str, split: str, key: str) -> CachedDataset:
    if not files:
        raise DataError(
            f"{key}: '{hub}' in {where} has no data file for split '{split}' "
            f"(hone reads {', '.join(sorted(set(SUFFIX_FORMATS.values())))})"
        )
    formats = {SUFFIX_FORMATS[f.suffix.lower()] for f in files}
    if len(formats) > 1:
        raise DataError(
            f"{key}: '{hub}' in {where} mixes file formats for split '{split}' ({', '.join(sorted(formats))}); "
            "point the path at one file"
        )
    return CachedDataset(tuple(files), formats.pop(), where)
