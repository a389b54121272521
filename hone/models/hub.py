"""Model ids (``Org/Name`` or ``Org/Name@revision``) resolved through the local Hugging Face cache.

Users' models already sit in the hub cache (``~/.cache/huggingface/hub``, or wherever
``HF_HUB_CACHE`` / ``HF_HOME`` point). hone finds a snapshot there with huggingface_hub's own
cache lookup (``snapshot_download(..., local_files_only=True)``), so the cache layout, refs and
commit hashes are read the way the library that wrote them reads them. Nothing is fetched:
only ``model.allow_download: true`` downloads, and then only weights (safetensors), configs and
tokenizer files, explicitly at the start of ``hone train`` (:func:`download_missing`), never
while validating.

A value is an id only when no local path of that name exists and it has the shape
``owner/name[@revision]``; a local directory keeps working exactly as before.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hone.models.errors import ModelError

if TYPE_CHECKING:
    from hone.config.model import ModelConfig

#: ``owner/name`` with the characters the Hub allows, then an optional ``@revision``
#: (a branch, tag or commit hash; branches may contain ``/``, e.g. ``refs/pr/1``).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")

#: What ``allow_download`` fetches: weights in safetensors only, configs and tokenizer files.
DOWNLOAD_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "*.json",  # config.json, generation_config.json, tokenizer.json, tokenizer_config.json, ...
    "*.model",  # sentencepiece / tiktoken vocabularies
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",  # chat templates shipped as files
]


class HubModelNotFound(ModelError):
    """A model id is not in the local hub cache (and downloading is not allowed)."""


@dataclass(frozen=True)
class HubId:
    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_hub_id(value: str | Path) -> HubId | None:
    """The id ``value`` spells (``owner/name[@revision]``), or None. Pure: looks at the text only."""
    match = _HUB_ID.match(str(value))
    if match is None:
        return None
    return HubId(match["repo"], match["revision"])


def hub_id_of(path: str | Path) -> HubId | None:
    """The hub id ``path`` means, or None when it is a local path (one that exists, or that
    cannot be an id: absolute, ``./x``, more than one ``/``)."""
    if Path(path).exists():
        return None
    return parse_hub_id(path)


def hub_cache_dir() -> Path:
    """The hub cache, read from the environment now (``HF_HUB_CACHE``, else ``HF_HOME/hub``,
    else huggingface_hub's default), so a changed environment is honoured without re-importing
    huggingface_hub, whose constants are fixed at import."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached_snapshot(hub: HubId, repo_type: str = "model") -> Path | None:
    """The snapshot directory of ``hub`` (a model, or a ``dataset`` repository) in the local
    cache, or None. Never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            hub.repo_id, repo_type=repo_type, revision=hub.revision, cache_dir=hub_cache_dir(), local_files_only=True
        )
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    return Path(folder)


def not_found_message(hub: HubId, key: str) -> str:
    """Which id, where hone looked, and the two ways to get it there."""
    revision = f" --revision {hub.revision}" if hub.revision else ""
    what = f"revision '{hub.revision}' of " if hub.revision else ""
    return (
        f"{key}: '{hub}' is neither a local directory nor {what}a model in the local Hugging Face "
        f"cache ({hub_cache_dir()}, set by HF_HUB_CACHE or HF_HOME); fetch it with "
        f"`huggingface-cli download {hub.repo_id}{revision}` (or `hf download`), or set "
        "model.allow_download: true to let `hone train` download its safetensors, config and "
        "tokenizer files"
    )


def local_model_dir(path: Path, key: str = "model.path") -> Path:
    """The directory to read for ``path``: itself when it is local, else the cached snapshot
    of the id it names. Raises :class:`HubModelNotFound` for an id that is not cached."""
    hub = hub_id_of(path)
    if hub is None:
        return Path(path)
    folder = cached_snapshot(hub)
    if folder is None:
        raise HubModelNotFound(not_found_message(hub, key))
    return folder


def base_model_reference(path: Path) -> tuple[str, str | None]:
    """How an adapter names its base model so it loads from any working directory: the hub id
    (and revision) of an id, else the absolute local directory (never the relative spelling of
    the config, which only means something in the directory the run started in)."""
    hub = hub_id_of(path)
    if hub is not None:
        return hub.repo_id, hub.revision
    return os.path.normpath(Path(path).absolute()), None


def model_hub_ids(model_cfg: ModelConfig) -> list[tuple[str, HubId]]:
    """``(key, id)`` for each of ``model.path`` / ``model.tokenizer_path`` that names a hub id."""
    found = []
    for key, value in (("model.path", model_cfg.path), ("model.tokenizer_path", model_cfg.tokenizer_path)):
        hub = hub_id_of(value) if value is not None else None
        if hub is not None and all(hub != other for _, other in found):
            found.append((key, hub))
    return found


def download_missing(model_cfg: ModelConfig, say=print) -> list[Path]:
    """With ``model.allow_download: true``, download the ids of ``model_cfg`` that are not cached
    (safetensors, configs and tokenizer files only, into the hub cache). Returns the snapshots
    downloaded. Without it, does nothing: a missing id is then reported by the checks."""
    if not model_cfg.allow_download:
        return []
    from huggingface_hub import snapshot_download

    done = []
    for key, hub in model_hub_ids(model_cfg):
        if cached_snapshot(hub) is not None:
            continue
        say(f"downloading {hub} ({key}) into {hub_cache_dir()} (model.allow_download: true)")
        try:
            folder = snapshot_download(
                hub.repo_id, revision=hub.revision, cache_dir=hub_cache_dir(), allow_patterns=DOWNLOAD_PATTERNS
            )
        except Exception as exc:  # network, auth, unknown repo: huggingface_hub raises many kinds
            raise HubModelNotFound(f"{key}: cannot download '{hub}': {type(exc).__name__}: {exc}") from None
        done.append(Path(folder))
    return done
