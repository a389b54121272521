"""Sample packing: documents -> bins of at most ``sequence_len`` tokens, deterministically.

Best-fit decreasing over shuffled groups: the rows are shuffled by seed and cut into groups
of ``group_size``; within a group, documents are placed longest first, each into the open bin
whose free space fits it most tightly (a new bin when none fits). Best fit is found in
O(log sequence_len) with a sorted list of the free-space values that have open bins, so 1M
documents pack in a few seconds of plain Python on one core. Bins are fixed once packed; the
training loop reshuffles their *order* every epoch, so a run's step count is known up front
and a resume finds the same bins.

A packing is two integer arrays in CSR form: ``docs`` (row indices, bin after bin) and
``offsets`` (``docs[offsets[i]:offsets[i+1]]`` are the rows of bin ``i``).

A split is packed once, here: :func:`packing_for` is the one place that turns a split and the
config into bins. ``prepare_data`` calls it and the bins are saved with the prepared data
(``<entry>/<split>.packing.npz``; the cache key holds every option the packing depends on), so
the training loop, each eval and ``hone bench`` load those bins instead of packing again.
Rows that did not come from the cache (in-memory datasets, lists in tests) are packed on the
spot, by the same function with the same seed, so the bins are the same either way.
"""

from __future__ import annotations

import hashlib
import io
from bisect import bisect_left, insort
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hone.atomic import atomic_write_bytes
from hone.errors import HoneError

if TYPE_CHECKING:
    from hone.config.root import HoneConfig

#: Default documents packed together (see ``data.sample_packing_group_size``).
DEFAULT_GROUP_SIZE = 100_000


@dataclass(frozen=True)
class Packing:
    """Rows of a split grouped into bins of at most ``capacity`` tokens."""

    docs: np.ndarray  # int64 row indices, bin after bin
    offsets: np.ndarray  # int64, len = bins + 1
    bin_tokens: np.ndarray  # int64 real tokens per bin
    capacity: int

    @property
    def num_bins(self) -> int:
        return len(self.offsets) - 1

    @property
    def tokens(self) -> int:
        return int(self.bin_tokens.sum())

    @property
    def efficiency(self) -> float:
        """Real tokens / token slots (bins x capacity)."""
        return self.tokens / (self.num_bins * self.capacity) if self.num_bins else 0.0

    @property
    def rows(self) -> int:
        """Documents (dataset rows) packed."""
        return len(self.docs)

    def bin(self, index: int) -> np.ndarray:
        return self.docs[self.offsets[index] : self.offsets[index + 1]]

    def most_segments(self, rows: int) -> int:
        """The most segments (documents, and a padding tail where a bin is not full) that any
        ``rows`` bins hold together: a bound on the boundaries of every micro-batch of ``rows``
        packed rows, whatever order the epochs draw the bins in (the ``rows`` fullest bins)."""
        per_bin = np.diff(self.offsets) + (self.bin_tokens < self.capacity)
        return int(np.sort(per_bin)[::-1][:rows].sum())

    def describe(self, rows: int | None = None) -> str:
        rows = self.rows if rows is None else rows
        return (
            f"{rows:,} rows -> {self.num_bins:,} packed rows of {self.capacity} tokens, "
            f"{100 * self.efficiency:.1f}% of token slots real"
        )


def pack(lengths: np.ndarray, capacity: int, seed: int, group_size: int = DEFAULT_GROUP_SIZE, shuffle: bool = True) -> Packing:
    """Pack rows of ``lengths`` tokens into bins of ``capacity`` (deterministic in ``seed``).

    ``shuffle=False`` packs the rows in their order (eval: no randomness needed).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.max() > capacity or lengths.min() < 1):
        bad = int(np.flatnonzero((lengths > capacity) | (lengths < 1))[0])
        raise HoneError(f"row {bad} has {int(lengths[bad])} tokens; packing needs 1..{capacity} (data.sequence_len)")
    order = np.random.default_rng([seed % 2**64, 0x5ACC]).permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    bins: list[np.ndarray] = []
    for start in range(0, len(order), group_size):
        group = order[start : start + group_size]
        bins += [group[np.asarray(b, dtype=np.int64)] for b in _best_fit_decreasing(lengths[group], capacity)]
    sizes = np.array([len(b) for b in bins], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    docs = np.concatenate(bins).astype(np.int64) if bins else np.zeros(0, dtype=np.int64)
    bin_tokens = np.add.reduceat(lengths[docs], offsets[:-1]) if len(docs) else np.zeros(0, dtype=np.int64)
    return Packing(docs=docs, offsets=offsets, bin_tokens=bin_tokens.astype(np.int64), capacity=capacity)


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of positions into ``lengths``), each summing to at most ``capacity``."""
    order = np.argsort(-lengths, kind="stable").tolist()
    sizes = lengths.tolist()
    open_by_free: list[list[int]] = [[] for _ in range(capacity + 1)]  # free space -> open bins
    free_values: list[int] = []  # sorted free-space values that have at least one open bin
    bins: list[list[int]] = []
    for item in order:
        size = sizes[item]
        k = bisect_left(free_values, size)
        if k == len(free_values):
            b = len(bins)
            bins.append([item])
            free = capacity - size
        else:
            tightest = free_values[k]
            stack = open_by_free[tightest]
            b = stack.pop()
            if not stack:
                del free_values[k]
            bins[b].append(item)
            free = tightest - size
        if free > 0:
            stack = open_by_free[free]
            if not stack:
                insort(free_values, free)
            stack.append(b)
    return bins


# ---------------------------------------------------------------- a split's bins, packed once

#: The splits a config can pack, and the file their bins are saved in inside a cache entry.
PACKING_FILES = {"train": "train.packing.npz", "eval": "eval.packing.npz"}


def row_lengths(dataset: Any) -> np.ndarray:
    """Token count of every row: the prepared ``length`` column, or measured from the rows."""
    if hasattr(dataset, "column_names") and "length" in dataset.column_names:
        return np.asarray(dataset["length"], dtype=np.int64)
    return np.array([len(dataset[i]["input_ids"]) for i in range(len(dataset))], dtype=np.int64)


def split_packing(lengths: np.ndarray, cfg: HoneConfig, split: str) -> Packing | None:
    """Bins for a split of rows of ``lengths`` tokens as ``cfg`` asks, or None when that split
    is not packed. Training rows are shuffled by ``training.seed`` and packed in groups of
    ``data.sample_packing_group_size``; eval rows are packed in their order, in one group (the
    eval loss does not depend on the order, so no randomness is spent on it)."""
    data = cfg.data
    if split not in PACKING_FILES:
        raise ValueError(f"split must be one of {sorted(PACKING_FILES)}, not {split!r}")
    if split == "train":
        if not data.sample_packing:
            return None
        return pack(lengths, data.sequence_len, cfg.training.seed, data.sample_packing_group_size)
    if not data.packs_eval:
        return None
    return pack(lengths, data.sequence_len, 0, max(1, len(lengths)), shuffle=False)


def packing_for(dataset: Any, cfg: HoneConfig, split: str) -> Packing | None:
    """The bins of ``split`` (``dataset``'s rows) under ``cfg``, or None when it is not packed.

    A split read from the prepared-data cache gets the bins saved beside it (packed and saved on
    the first call); any other rows are packed now. Either way the result is the same bins."""
    if dataset is None:
        return None
    data = cfg.data
    if not (data.sample_packing if split == "train" else data.packs_eval):
        return None
    lengths = row_lengths(dataset)
    file = _saved_bins_file(dataset, split)
    if file is not None:
        saved = load_packing(file, lengths) if file.is_file() else None
        if saved is not None and saved.capacity == data.sequence_len:
            return saved
    packing = split_packing(lengths, cfg, split)
    assert packing is not None
    if file is not None:
        try:
            save_packing(packing, lengths, file)
        except OSError:
            pass  # a read-only cache still trains; the next run packs again
    return packing


def save_packing(packing: Packing, lengths: np.ndarray, path: Path) -> None:
    """Write ``packing`` (of rows of ``lengths`` tokens) to ``path`` atomically."""
    buffer = io.BytesIO()
    np.savez(
        buffer,
        docs=packing.docs,
        offsets=packing.offsets,
        bin_tokens=packing.bin_tokens,
        capacity=np.int64(packing.capacity),
        lengths_sha256=np.array(_digest(lengths)),
    )
    atomic_write_bytes(Path(path), buffer.getvalue())


def load_packing(path: Path, lengths: np.ndarray | None = None) -> Packing | None:
    """The packing saved at ``path``; None when it is unreadable or (given ``lengths``) was
    made for other rows, so the caller packs again instead of training on wrong bins."""
    try:
        with np.load(Path(path), allow_pickle=False) as saved:
            if lengths is not None and str(saved["lengths_sha256"]) != _digest(lengths):
                return None
            return Packing(
                docs=saved["docs"].astype(np.int64),
                offsets=saved["offsets"].astype(np.int64),
                bin_tokens=saved["bin_tokens"].astype(np.int64),
                capacity=int(saved["capacity"]),
            )
    except (OSError, ValueError, KeyError):
        return None


def _digest(lengths: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(lengths, dtype=np.int64).tobytes()).hexdigest()


def _saved_bins_file(dataset: Any, split: str) -> Path | None:
    """Where the bins of a split read from a cache entry live (``<entry>/<split>.packing.npz``),
    or None for rows held in memory. The entry is found from the split's own Arrow files
    (``<entry>/<split>/*.arrow``, ``datasets``' ``cache_files``)."""
    files = getattr(dataset, "cache_files", None)
    if not files:
        return None
    split_dir = Path(files[0]["filename"]).parent
    entry = split_dir.parent
    if split_dir.name != split or not (entry / "stats.json").is_file():
        return None
    return entry / PACKING_FILES[split]
