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
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np

from hone.errors import HoneError

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

    def bin(self, index: int) -> np.ndarray:
        return self.docs[self.offsets[index] : self.offsets[index + 1]]

    def describe(self, rows: int) -> str:
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
