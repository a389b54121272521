"""Validation split, mixing weights and shuffling, as index arithmetic (pure numpy).

Everything is decided on row indices of the already-encoded datasets, so the rows are copied
once, when the final order is written. Every random choice comes from its own generator,
seeded by ``training.seed``, a purpose and the dataset's position, so changing one dataset's
weight does not reshuffle which rows another one holds out.

Order of operations, per training dataset: hold out ``val_set_size`` of its rows for
evaluation (stratified: each dataset gives the same fraction), then apply ``weight`` to the
rest; the weighted rows of all datasets are concatenated and shuffled. Held-out rows are never
repeated or dropped by the weight, and never also appear in training.
"""

from __future__ import annotations

import numpy as np

# Purposes, so the generators of different decisions are independent.
_SPLIT, _WEIGHT, _SHUFFLE = 1, 2, 3


def rng_for(seed: int, purpose: int, index: int = 0) -> np.random.Generator:
    """A generator for one decision; ``seed`` may be any int (negative ones included)."""
    return np.random.default_rng([seed % (1 << 63), purpose, index])


def hold_out(n: int, fraction: float, seed: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, eval rows), both sorted: ``round(n * fraction)`` rows go to eval."""
    n_eval = int(round(n * fraction))
    perm = rng_for(seed, _SPLIT, index).permutation(n)
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


def apply_weight(rows: np.ndarray, weight: float, seed: int, index: int) -> np.ndarray:
    """Each row ``weight`` times on average: every row ``int(weight)`` times, plus a seeded
    random subset of ``round(frac * len(rows))`` rows for the fractional part."""
    whole = int(weight)
    extra = int(round((weight - whole) * len(rows)))
    parts = [rows] * whole
    if extra:
        parts.append(np.sort(rng_for(seed, _WEIGHT, index).choice(rows, size=extra, replace=False)))
    if not parts:
        return np.empty(0, dtype=np.int64)
    return np.concatenate(parts).astype(np.int64, copy=False)


def shuffled(rows: np.ndarray, seed: int) -> np.ndarray:
    """``rows`` in a seeded random order."""
    return rows[rng_for(seed, _SHUFFLE).permutation(len(rows))]
