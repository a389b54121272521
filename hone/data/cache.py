"""The prepared-data cache: a content-hash key, atomic entries, a memo of file hashes.

An entry is ``<root>/<key>/`` holding ``train/`` (and ``eval/``) written by
``Dataset.save_to_disk``, ``stats.json`` and ``key.json`` (what went into the key, for
"why did this miss?"). The key is a hash of everything the output depends on:

- the bytes of every data file (not its path or mtime: moving a file keeps the cache, editing
  it misses);
- the tokenizer (its full serialisation, special tokens, chat template, and the ids of a
  probe text, which also captures BOS/EOS-adding behaviour);
- every data option that changes the output (all of ``data`` except ``num_proc``,
  ``dataset_prepared_path`` and ``allow_longer_than_model``; new options are included
  automatically) and ``training.seed``;
- :data:`DATA_FORMAT_VERSION`, bumped whenever hone's encoding changes, and as a safety net
  a digest of the source of ``hone/data`` and the versions of the libraries that render and
  tokenize (transformers, tokenizers, datasets, jinja2): upgrading hone or a library costs
  one rebuild instead of silently reusing rows encoded by other code.

An entry is built in a staging directory next to it and renamed into place only when
complete, so an error, Ctrl-C or a kill never leaves a half-written entry that a later run
would load; staging directories of dead processes are removed by the next run.

Hashing a large file takes time, so hashes are memoised in ``<root>/file_hashes.json`` by
(path, size, mtime, inode). Like git's index, a memo is trusted only if the file's mtime was
more than :data:`RACY_NS` older than the moment it was hashed: a file rewritten within the
file system's timestamp granularity of being hashed is always hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hone.atomic import atomic_write_text, normal_dir_mode
from hone.config.data import DataConfig
from hone.config.root import HoneConfig
from hone.data.errors import DataError
from hone.processes import pid_alive

#: Bump when the encoding of rows changes (labels, EOS, columns, dtypes), to invalidate caches.
DATA_FORMAT_VERSION = 1
INDEX_NAME = "file_hashes.json"
RACY_NS = 2_000_000_000
STAGING_PREFIX = ".tmp-"
_OWNER = "owner.json"
_STALE_FOREIGN_S = 24 * 3600


def cache_root(data: DataConfig) -> Path:
    """``data.dataset_prepared_path``, else ``$HONE_CACHE_DIR/datasets``, else ``~/.cache/hone/datasets``."""
    if data.dataset_prepared_path is not None:
        return data.dataset_prepared_path
    env = os.environ.get("HONE_CACHE_DIR")
    if env:
        return Path(env) / "datasets"
    return Path.home() / ".cache" / "hone" / "datasets"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class FileHasher:
    """SHA-256 of data files, memoised in ``index_path`` (None: no memo, always hash)."""

    def __init__(self, index_path: Path | None) -> None:
        self.index_path = index_path
        self._index: dict[str, dict[str, Any]] = {}
        self._dirty = False
        if index_path is not None and index_path.is_file():
            try:
                loaded = json.loads(index_path.read_text(encoding="utf-8"))
                self._index = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                self._index = {}  # a damaged memo only costs re-hashing

    def sha256(self, path: Path) -> str:
        resolved = str(path.resolve())
        st = path.stat()
        signature = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]
        entry = self._index.get(resolved)
        if (
            isinstance(entry, dict)
            and entry.get("signature") == signature
            and isinstance(entry.get("hashed_at_ns"), int)
            and entry["hashed_at_ns"] - st.st_mtime_ns > RACY_NS
        ):
            return str(entry["sha256"])
        hashed_at = time.time_ns()  # taken before reading: a write during the read looks racy
        digest = sha256_file(path)
        self._index[resolved] = {"signature": signature, "sha256": digest, "hashed_at_ns": hashed_at}
        self._dirty = True
        return digest

    def save(self) -> None:
        if self.index_path is None or not self._dirty:
            return
        atomic_write_text(self.index_path, json.dumps(self._index, indent=1, sort_keys=True))
        self._dirty = False


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash that changes whenever the tokenizer would encode or template anything differently."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    probe = "Hello, world! 12 <|probe|>\n"
    details = {
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special_tokens": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
        "size": len(tokenizer),
        "probe": list(tokenizer(probe, add_special_tokens=True)["input_ids"]),
        "probe_plain": list(tokenizer(probe, add_special_tokens=False)["input_ids"]),
    }
    digest.update(json.dumps(details, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def code_fingerprint() -> dict[str, str]:
    """Digest of the data pipeline's source and the versions of the libraries it relies on."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    out = {"hone_data_source": digest.hexdigest()}
    for package in ("transformers", "tokenizers", "datasets", "jinja2"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "absent"
    return out


def key_inputs(cfg: HoneConfig, tokenizer: Any, hasher: FileHasher) -> dict[str, Any]:
    """Everything the prepared data depends on, as a JSON-able dict (saved as ``key.json``)."""
    data = cfg.data

    def dataset(entry: Any) -> dict[str, Any]:
        dumped = entry.model_dump(mode="json", exclude={"path", "file_format"})
        dumped["file_format"] = entry.resolved_format
        hashes = [hasher.sha256(file) for file in entry.files]  # a hub id's files: each of them, in order
        dumped["sha256"] = hashes[0] if len(hashes) == 1 else hashes
        return dumped

    return {
        "hone_data_format": DATA_FORMAT_VERSION,
        "code": code_fingerprint(),
        "datasets": [dataset(d) for d in data.datasets],
        "test_datasets": [dataset(d) for d in data.test_datasets],
        "options": data.model_dump(
            mode="json", exclude={"datasets", "test_datasets", "num_proc", "dataset_prepared_path", "allow_longer_than_model"}
        ),
        "seed": cfg.training.seed,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }


def key_of(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


# ---------------------------------------------------------------- staging and publishing


def remove_stale_staging(root: Path) -> None:
    """Delete staging directories left by processes that died (crash, kill -9)."""
    host = socket.gethostname()
    for path in root.glob(f"{STAGING_PREFIX}*"):
        if not path.is_dir():
            continue
        try:
            owner = json.loads((path / _OWNER).read_text(encoding="utf-8"))
            same_host = owner.get("host") == host
            dead = same_host and not pid_alive(int(owner["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            same_host, dead = False, False
        old = time.time() - path.stat().st_mtime > _STALE_FOREIGN_S
        if dead or (not same_host and old):
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def staging_dir(parent: Path, key: str, *, clean_stale: bool = True) -> Iterator[Path]:
    """A fresh directory under ``parent``, deleted on exit unless it was renamed away.

    ``clean_stale`` also removes dead runs' staging directories; only for a cache root,
    where every ``.tmp-*`` entry is hone's.
    """

    def unwritable(exc: OSError) -> DataError:
        return DataError(
            f"cannot write the prepared-data cache under '{parent}' ({exc.strerror or exc}): set "
            "data.dataset_prepared_path or $HONE_CACHE_DIR to a writable directory"
        )

    try:
        parent.mkdir(parents=True, exist_ok=True)
        if clean_stale:
            remove_stale_staging(parent)
        path = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{key[:12]}-", dir=parent))
    except OSError as exc:
        raise unwritable(exc) from exc
    try:  # from here on, whatever happens (Ctrl-C included) removes the directory
        try:
            (path / _OWNER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}), encoding="utf-8")
        except OSError as exc:
            raise unwritable(exc) from exc
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def publish(staged: Path, entry: Path) -> None:
    """Rename a complete staging directory to its entry name (atomic on one file system).

    If another process published the same key first, its entry is kept and ours discarded:
    both are built from the same inputs.
    """
    (staged / _OWNER).unlink(missing_ok=True)
    normal_dir_mode(staged)  # mkdtemp's 0700 would keep the cache from the other users of a shared cache dir
    try:
        os.rename(staged, entry)
    except OSError:
        if not entry.is_dir():
            raise


def discard(entry: Path) -> None:
    """Remove an unusable entry without ever exposing a half-deleted one under its name."""
    aside = entry.with_name(f"{STAGING_PREFIX}discard-{entry.name}-{os.getpid()}")
    try:
        os.rename(entry, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)
