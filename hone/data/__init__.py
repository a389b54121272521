"""Local data files -> formatted, tokenized, label-masked, cached datasets.

Entry point: :func:`hone.data.prepare.prepare_data`. Modules, in pipeline order:
``load`` (files through HF ``datasets``), ``formats`` / ``chat`` (a row -> text and trained
spans, or token ids), ``encode`` (tokenize, labels, length policy), ``mix`` (validation split,
weights, shuffle), ``cache`` (content-hash key, atomic writes), ``stats`` / ``summary``.

The public names below are imported lazily so that ``import hone.data.errors`` stays cheap.
"""

import os
from typing import Any

# Offline first: ``datasets`` reads this once, when it is imported, so it is set before any
# submodule imports it. Only local files are ever loaded; this makes sure nothing reaches
# for the Hub either. A value the user exported wins.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

__all__ = ["DataError", "DataStats", "PreparedData", "prepare_data", "render_summary"]


def __getattr__(name: str) -> Any:
    if name == "DataError":
        from hone.data.errors import DataError

        return DataError
    if name == "DataStats":
        from hone.data.stats import DataStats

        return DataStats
    if name in ("PreparedData", "prepare_data"):
        from hone.data import prepare

        return getattr(prepare, name)
    if name == "render_summary":
        from hone.data.summary import render_summary

        return render_summary
    raise AttributeError(f"module 'hone.data' has no attribute '{name}'")
