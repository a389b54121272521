"""The ``data: lengths`` workload: documents of random tokens with a realistic length mix.

Chat and instruction data is mostly short documents with a long tail, which is what makes
padding expensive and packing pay. Lengths are log-normal (``length_median``, ``length_sigma``)
clipped to ``[min_length, sequence_len]`` and seeded, so every condition of a spec trains on
the same documents; every token is trained except each document's first (as in prepared data).
"""

import json
from pathlib import Path

import numpy as np

from hone.bench.spec import Workload

#: Shortest document generated (a one-token document trains nothing).
MIN_LENGTH = 8


def document_lengths(workload: Workload, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 0x1E6])
    raw = rng.lognormal(np.log(workload.length_median), workload.length_sigma, workload.documents)
    return np.clip(np.round(raw), MIN_LENGTH, workload.sequence_len).astype(np.int64)


def write_length_mix(path: Path, workload: Workload, id_limit: int, seed: int) -> np.ndarray:
    """Write the documents as a ``pretokenized`` JSONL file; returns their lengths."""
    lengths = document_lengths(workload, seed)
    rng = np.random.default_rng([seed, 0x1D5])
    with path.open("w") as f:
        for length in lengths.tolist():
            ids = rng.integers(1, id_limit, length).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [-100] + ids[1:]}) + "\n")
    return lengths


def attention_span(lengths: np.ndarray) -> float:
    """The sequence length that makes the FLOP model's attention term right for documents of
    ``lengths`` attended one by one: sum(n^2) / sum(n) (a token of an n-token document costs
    attention over n/2 keys on average, as a token of an n-token sequence does)."""
    lengths = lengths.astype(np.float64)
    return float((lengths**2).sum() / lengths.sum())
