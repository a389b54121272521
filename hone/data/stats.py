"""What preprocessing did, as plain dataclasses that round-trip through JSON.

Saved as ``stats.json`` next to the cached datasets, so a cache hit prints the same summary
as the run that built it. Counts of dropped, skipped and truncated rows are over rows of the
files (before weighting); rows and tokens of a split are over what the split holds (after
weighting, so a row with weight 2 counts twice).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

#: Bars in the length histogram.
HISTOGRAM_BINS = 10
#: Messages of skipped bad rows kept per dataset, to show in the summary.
MAX_EXAMPLES = 3


@dataclass
class LengthBin:
    """Rows whose token count lies in ``[lo, hi]``."""

    lo: int
    hi: int
    count: int


@dataclass
class SourceStats:
    """One data file: what was read, dropped and used."""

    path: str
    type: str
    split: str  # "train" (data.datasets) or "eval" (data.test_datasets)
    weight: float
    rows_read: int = 0
    bad_rows_skipped: int = 0
    dropped_too_long: int = 0
    dropped_no_trained: int = 0
    truncated: int = 0
    rows_kept: int = 0
    rows_train: int = 0  # rows this file contributes to the train split (after weighting)
    rows_eval: int = 0  # rows held out for eval, or contributed to eval by a test dataset
    skipped_examples: list[str] = field(default_factory=list)
    #: Preference pairs whose prompt alone leaves no room in ``sequence_len`` (dropped), with examples.
    dropped_prompt_too_long: int = 0
    dropped_examples: list[str] = field(default_factory=list)


@dataclass
class SplitStats:
    rows: int
    tokens: int
    trained_tokens: int
    min_length: int
    max_length: int
    histogram: list[LengthBin]
    bad_rows_skipped: int = 0
    dropped_too_long: int = 0
    dropped_no_trained: int = 0
    truncated: int = 0
    #: Preference splits (a row is a pair): token totals and maxima of prompts, chosen and
    #: rejected completions; ``pairs`` is False (and these are 0) for SFT rows.
    pairs: bool = False
    prompt_tokens: int = 0
    chosen_tokens: int = 0
    rejected_tokens: int = 0
    max_prompt: int = 0
    max_chosen: int = 0
    max_rejected: int = 0
    max_pair_tokens: int = 0
    """The longest pair with its prompt once: the largest prompt + chosen + rejected of one row
    (0 in statistics written before it was counted: bound it by the three maxima then)."""

    @property
    def mean_length(self) -> float:
        return self.tokens / self.rows if self.rows else 0.0

    @classmethod
    def from_arrays(
        cls, lengths: np.ndarray, trained: np.ndarray, sources: list[SourceStats], parts: np.ndarray | None = None
    ) -> SplitStats:
        """Statistics of a split from its rows' lengths and trained-token counts (and, for
        preference pairs, ``parts``: one row of prompt, chosen and rejected lengths per pair)."""
        extra: dict[str, Any] = {}
        if parts is not None:
            parts = parts.reshape(-1, 3)
            totals, maxima = parts.sum(axis=0), parts.max(axis=0) if len(parts) else np.zeros(3, dtype=np.int64)
            extra = {"pairs": True, "prompt_tokens": int(totals[0]), "chosen_tokens": int(totals[1])}
            extra |= {"rejected_tokens": int(totals[2]), "max_prompt": int(maxima[0]), "max_chosen": int(maxima[1])}
            extra["max_rejected"] = int(maxima[2])
            extra["max_pair_tokens"] = int(parts.sum(axis=1).max()) if len(parts) else 0
        return cls(
            **extra,
            rows=int(len(lengths)),
            tokens=int(lengths.sum()),
            trained_tokens=int(trained.sum()),
            min_length=int(lengths.min()) if len(lengths) else 0,
            max_length=int(lengths.max()) if len(lengths) else 0,
            histogram=length_histogram(lengths),
            bad_rows_skipped=sum(s.bad_rows_skipped for s in sources),
            dropped_too_long=sum(s.dropped_too_long for s in sources),
            dropped_no_trained=sum(s.dropped_no_trained for s in sources),
            truncated=sum(s.truncated for s in sources),
        )


@dataclass
class DataStats:
    sequence_len: int
    excess_length_strategy: str
    train: SplitStats
    eval: SplitStats | None
    sources: list[SourceStats]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> DataStats:
        raw = json.loads(text)

        def split(data: dict[str, Any] | None) -> SplitStats | None:
            if data is None:
                return None
            return SplitStats(**{**data, "histogram": [LengthBin(**b) for b in data["histogram"]]})

        return cls(
            sequence_len=raw["sequence_len"],
            excess_length_strategy=raw["excess_length_strategy"],
            train=split(raw["train"]),  # type: ignore[arg-type]
            eval=split(raw["eval"]),
            sources=[SourceStats(**s) for s in raw["sources"]],
        )


def length_histogram(lengths: np.ndarray, bins: int = HISTOGRAM_BINS) -> list[LengthBin]:
    """Up to ``bins`` equal-width integer bins from the shortest to the longest row."""
    if len(lengths) == 0:
        return []
    lo, hi = int(lengths.min()), int(lengths.max())
    width = max(1, math.ceil((hi - lo + 1) / bins))
    counts = np.bincount((lengths - lo) // width)
    return [LengthBin(lo + i * width, min(hi, lo + (i + 1) * width - 1), int(c)) for i, c in enumerate(counts)]
