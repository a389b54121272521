"""``prepare_data``: config + tokenizer -> tokenized, label-masked train/eval datasets, cached.

Steps (each in its own module): look the inputs up in the cache (``cache``); on a miss, per
dataset file: load (``load``), check its columns and encode every row with ``datasets.map``
(``formats``/``chat`` + ``encode``), stop on the first bad row or skip and count them
(``data.on_bad_row``), drop rows that are too long or train nothing; then hold out the
validation rows, apply weights and shuffle (``mix``), write the splits and ``stats.json``
into a staging directory and rename it into the cache. With ``data.sample_packing`` the
splits are then packed once and their bins saved in the entry too (``packing``).

The returned datasets have exactly the columns ``input_ids``, ``labels`` (lists of int64 of
equal length, ``1 <= len <= sequence_len``, at least one label that is not -100) and
``length``; for ``preference`` data (pairs, never packed here) the columns of
:data:`hone.data.preference_encode.PREFERENCE_COLUMNS` instead.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from hone.atomic import atomic_write_text
from hone.config.root import HoneConfig
from hone.data import mix
from hone.data.cache import (
    INDEX_NAME,
    FileHasher,
    cache_root,
    discard,
    key_inputs,
    key_of,
    publish,
    staging_dir,
)
from hone.data.encode import (
    ENCODED_FEATURES,
    STATUS_BAD_ROW,
    STATUS_NO_TRAINED,
    STATUS_OK,
    STATUS_TEMPLATE,
    STATUS_TOO_LONG,
    RowEncoder,
)
from hone.data.errors import DataError, at_row
from hone.data.formats import Source
from hone.data.interrupt import check_interrupted, interruptible, workers_run
from hone.data.load import check_file, load_file
from hone.data.packing import Packing, packing_for
from hone.data.preference import PreferenceFormat
from hone.data.preference_encode import PREFERENCE_COLUMNS, PREFERENCE_FEATURES, STATUS_PROMPT_TOO_LONG, PreferenceEncoder
from hone.data.row_format import make_format
from hone.data.stats import MAX_EXAMPLES, DataStats, SourceStats, SplitStats

OUTPUT_COLUMNS = ("input_ids", "labels", "length")
_TEXT_FORMATS = ("alpaca", "chat", "completion")
_EOS_FORMATS = ("alpaca", "completion", "preference")


@dataclass
class PreparedData:
    train: datasets.Dataset
    eval: datasets.Dataset | None
    stats: DataStats
    #: The cache entry (when ``cache_enabled`` is False: where it would have been).
    cache_dir: Path
    cache_hit: bool
    cache_enabled: bool = True
    #: The bins of each split that ``data.sample_packing`` / ``eval_sample_packing`` packs
    #: (packed once and saved in the cache entry beside the split; see :mod:`hone.data.packing`).
    packing: dict[str, Packing] | None = None


@dataclass
class _Encoded:
    """One file after encoding and dropping: the rows, their lengths and trained counts."""

    dataset: datasets.Dataset
    lengths: np.ndarray
    trained: np.ndarray
    weight: float
    stats: SourceStats
    #: Preference pairs: ``[prompt, chosen, rejected]`` lengths per row; None for SFT rows.
    parts: np.ndarray | None = None


def prepare_data(cfg: HoneConfig, tokenizer: Any, *, use_cache: bool = True) -> PreparedData:
    """Tokenized train (and eval) datasets for ``cfg``, from the cache when the inputs match.

    ``use_cache=False`` neither reads nor writes the cache (the datasets are kept in memory).
    Raises :class:`DataError` for any problem with the data or data options.
    """
    from hone.data.hub_files import with_cached_data_files

    cfg = with_cached_data_files(cfg)  # hf://datasets/... entries: their files in the local hub cache
    prepared = _prepare(cfg, tokenizer, use_cache=use_cache)
    prepared.packing = _packing(cfg, prepared)
    return prepared


def prepared_stats(cfg: HoneConfig, tokenizer: Any) -> DataStats | None:
    """The statistics of the prepared data this config would train on, where ``hone preprocess``
    (or a run) has written them to the cache; None where it has not, or the files or the cache
    cannot be read. Never tokenizes or writes anything: for ``hone plan``, which reads no data."""
    from hone.data.hub_files import with_cached_data_files

    try:
        cfg = with_cached_data_files(cfg)
        for _, entries in _sections(cfg):
            if not all(Path(file).is_file() for entry in entries for file in entry.files):
                return None
        stats_file = _cache_entry(cfg, tokenizer, use_cache=True)[3] / "stats.json"
        if not stats_file.is_file():
            return None
        stats = DataStats.from_json(stats_file.read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 - the plan then assumes the config's bounds, as without a cache
        return None
    _relabel(stats, cfg)
    return stats


def _packing(cfg: HoneConfig, prepared: PreparedData) -> dict[str, Packing] | None:
    """Pack the splits once, as training will (same seed); the bins are saved in the cache
    entry, so a cache hit (and the training loop, and each eval) loads them instead."""
    if cfg.data.is_preference:
        return None  # pairs are packed by the preference objective, not as SFT rows
    splits = {"train": prepared.train, "eval": prepared.eval}
    out = {name: packing_for(split, cfg, name) for name, split in splits.items()}
    return {name: packing for name, packing in out.items() if packing is not None} or None


def _cache_entry(cfg: HoneConfig, tokenizer: Any, *, use_cache: bool) -> tuple[Path, FileHasher, dict[str, Any], Path]:
    """(cache root, file hasher, the key's inputs, the entry's directory) of ``cfg``'s prepared
    data: one naming for the run that builds the entry and for ``hone plan``, which only reads it.
    Without the cache the hasher keeps no index (nothing is written)."""
    root = cache_root(cfg.data)
    hasher = FileHasher(root / INDEX_NAME if use_cache else None)
    inputs = key_inputs(cfg, tokenizer, hasher)
    return root, hasher, inputs, root / key_of(inputs)


def _prepare(cfg: HoneConfig, tokenizer: Any, *, use_cache: bool) -> PreparedData:
    _check_tokenizer(cfg, tokenizer)
    for section, entries in _sections(cfg):
        for index, entry in enumerate(entries):
            for file in entry.files:
                check_file(file, f"data.{section}[{index}]")
    root, hasher, inputs, entry = _cache_entry(cfg, tokenizer, use_cache=use_cache)
    key = entry.name

    if use_cache:
        hit = _load_entry(entry, keep_in_memory=False)
        if hit is not None:
            _relabel(hit[2], cfg)
            _save_memo(hasher)
            return PreparedData(hit[0], hit[1], hit[2], entry, cache_hit=True)
        if entry.exists():
            discard(entry)  # damaged (e.g. edited by hand): rebuild it

    parent = root if use_cache else Path(tempfile.gettempdir())
    with interruptible(), staging_dir(parent, key, clean_stale=use_cache) as stage:
        stats = _build(cfg, tokenizer, stage)
        atomic_write_text(stage / "stats.json", stats.to_json())
        inputs["paths"] = [str(e.path) for _, entries in _sections(cfg) for e in entries]
        atomic_write_text(stage / "key.json", json.dumps(inputs, indent=2, sort_keys=True))
        shutil.rmtree(stage / "scratch", ignore_errors=True)
        if not use_cache:
            loaded = _load_entry(stage, keep_in_memory=True)
            assert loaded is not None, "a freshly written entry must load"
            return PreparedData(loaded[0], loaded[1], stats, entry, cache_hit=False, cache_enabled=False)
        check_interrupted()  # never publish a build that Ctrl-C stopped, even if a library swallowed it
        publish(stage, entry)
    _save_memo(hasher)
    loaded = _load_entry(entry, keep_in_memory=False)
    if loaded is None:
        raise DataError(f"the prepared data written to '{entry}' cannot be read back; is the directory shared or full?")
    _relabel(loaded[2], cfg)
    return PreparedData(loaded[0], loaded[1], loaded[2], entry, cache_hit=False)


# ---------------------------------------------------------------- checks


def _sections(cfg: HoneConfig) -> list[tuple[str, list[Any]]]:
    return [("datasets", list(cfg.data.datasets)), ("test_datasets", list(cfg.data.test_datasets))]


def _check_tokenizer(cfg: HoneConfig, tokenizer: Any) -> None:
    types = {e.type for _, entries in _sections(cfg) for e in entries}
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if types & set(_TEXT_FORMATS) and not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"the tokenizer '{name}' is not a fast (Rust) tokenizer; alpaca, chat and completion data need one "
            "(a tokenizer.json) to map trained text to tokens"
        )
    if types & set(_EOS_FORMATS) and tokenizer.eos_token_id is None:
        raise DataError(f"the tokenizer '{name}' has no eos token; alpaca, completion and preference rows end with one")


def _save_memo(hasher: FileHasher) -> None:
    try:
        hasher.save()
    except OSError:
        pass  # the memo only saves time; a read-only cache still works


# ---------------------------------------------------------------- building


def _build(cfg: HoneConfig, tokenizer: Any, stage: Path) -> DataStats:
    data = cfg.data
    seed = cfg.training.seed
    scratch = stage / "scratch"
    if data.num_proc and data.num_proc > 1:
        # Workers are forked after the parent used the tokenizer; each is one process anyway.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    train_parts = [_encode_file(cfg, tokenizer, "datasets", i, e, "train", scratch) for i, e in enumerate(data.datasets)]
    eval_parts = [_encode_file(cfg, tokenizer, "test_datasets", i, e, "eval", scratch) for i, e in enumerate(data.test_datasets)]

    train_rows: list[np.ndarray] = []
    held_out: list[np.ndarray] = []
    for i, part in enumerate(train_parts):
        rows = np.arange(len(part.dataset), dtype=np.int64)
        if data.val_set_size > 0:
            rows, eval_rows = mix.hold_out(len(rows), data.val_set_size, seed, i)
            held_out.append(eval_rows)
            part.stats.rows_eval = len(eval_rows)
        weighted = mix.apply_weight(rows, part.weight, seed, i)
        part.stats.rows_train = len(weighted)
        train_rows.append(weighted)

    if sum(len(r) for r in train_rows) == 0:
        raise DataError(
            "no training rows left after the validation split and weights "
            f"(data.val_set_size = {data.val_set_size}, weights {[p.weight for p in train_parts]}); "
            "lower val_set_size or raise a weight"
        )
    train_stats = _write_split(train_parts, train_rows, seed, 0, stage / "train", [p.stats for p in train_parts])

    eval_stats: SplitStats | None = None
    if data.val_set_size > 0:
        total = sum(len(r) for r in held_out)
        if total == 0:
            raise DataError(
                f"data.val_set_size = {data.val_set_size} of {sum(len(p.dataset) for p in train_parts)} usable rows "
                "holds out no row: raise it, or use data.test_datasets"
            )
        eval_stats = _write_split(train_parts, held_out, seed, 1, stage / "eval", [])
    elif eval_parts:
        eval_rows = []
        for j, part in enumerate(eval_parts):
            weighted = mix.apply_weight(np.arange(len(part.dataset), dtype=np.int64), part.weight, seed, 1000 + j)
            part.stats.rows_eval = len(weighted)
            eval_rows.append(weighted)
        if sum(len(r) for r in eval_rows) == 0:
            raise DataError("data.test_datasets leave no eval row after their weights: raise a weight")
        eval_stats = _write_split(eval_parts, eval_rows, seed, 1, stage / "eval", [p.stats for p in eval_parts])

    return DataStats(
        sequence_len=data.sequence_len,
        excess_length_strategy=data.excess_length_strategy,
        train=train_stats,
        eval=eval_stats,
        sources=[p.stats for p in train_parts + eval_parts],
    )


def _encode_file(cfg: HoneConfig, tokenizer: Any, section: str, index: int, entry: Any, split: str, scratch: Path) -> _Encoded:
    data = cfg.data
    key = f"data.{section}[{index}]"
    source = Source(entry.path, key)
    fmt = make_format(entry, source, tokenizer, data.chat_template)
    raw = load_file(entry.files, entry.resolved_format, scratch / "hf", key)
    fmt.check_columns(list(raw.column_names))

    truncate = data.excess_length_strategy == "truncate"
    if isinstance(fmt, PreferenceFormat):
        encoder: Any = PreferenceEncoder(fmt, tokenizer, data.sequence_len, truncate)
    else:
        encoder = RowEncoder(fmt, tokenizer, data.sequence_len, truncate)
    tag = f"{section}-{index}"
    num_proc = data.num_proc if data.num_proc and data.num_proc > 1 and len(raw) > 1 else None
    with workers_run(active=num_proc is not None):  # a Ctrl-C stops the workers, not the pool's machinery
        encoded = raw.map(
            encoder,
            batched=True,
            batch_size=256,
            remove_columns=list(raw.column_names),
            features=PREFERENCE_FEATURES if isinstance(fmt, PreferenceFormat) else ENCODED_FEATURES,
            num_proc=num_proc,
            cache_file_name=str(scratch / f"encoded-{tag}.arrow"),
            new_fingerprint=f"hone-encoded-{tag}",  # skip hashing the function (and the tokenizer in it)
            load_from_cache_file=False,
            desc=f"tokenizing {entry.path.name if len(entry.files) == 1 and entry.files[0] == entry.path else entry.path}",
        )

    columns = encoded.select_columns(["status", "truncated", "length", "n_trained"]).with_format("numpy")[:]
    status = np.asarray(columns["status"])
    stats = SourceStats(path=str(entry.path), type=entry.type, split=split, weight=entry.weight, rows_read=len(raw))

    def problem_at(row: int) -> str:
        return at_row(entry.path, row + 1, encoded[int(row)]["problem"])

    template_rows = np.flatnonzero(status == STATUS_TEMPLATE)
    if len(template_rows):
        raise DataError(f"{problem_at(template_rows[0])} ({key}, type {entry.type})")
    prompt_rows = np.flatnonzero(status == STATUS_PROMPT_TOO_LONG)
    if len(prompt_rows) and data.excess_length_strategy == "truncate":
        raise DataError(
            f"{problem_at(prompt_rows[0])} ({key}, type preference); data.excess_length_strategy: truncate cuts "
            "completions, never the prompt: shorten the prompt, raise data.sequence_len, or set "
            "data.excess_length_strategy: drop to drop such pairs"
        )
    stats.dropped_prompt_too_long = int(len(prompt_rows))
    stats.dropped_examples = [problem_at(r) for r in prompt_rows[:MAX_EXAMPLES]]
    bad_rows = np.flatnonzero(status == STATUS_BAD_ROW)
    if len(bad_rows) and data.on_bad_row == "error":
        raise DataError(
            f"{problem_at(bad_rows[0])} ({key}, type {entry.type}); fix the row, or set data.on_bad_row: skip "
            "to skip bad rows and count them"
        )
    stats.bad_rows_skipped = int(len(bad_rows))
    stats.skipped_examples = [problem_at(r) for r in bad_rows[:MAX_EXAMPLES]]
    stats.dropped_too_long = int((status == STATUS_TOO_LONG).sum())
    stats.dropped_no_trained = int((status == STATUS_NO_TRAINED).sum())
    keep = np.flatnonzero(status == STATUS_OK)
    stats.truncated = int(np.asarray(columns["truncated"])[keep].sum())
    stats.rows_kept = int(len(keep))
    if len(keep) == 0:
        raise DataError(_nothing_left(entry.path, key, stats, data.sequence_len))

    lengths = np.asarray(columns["length"])[keep].astype(np.int64)
    trained = np.asarray(columns["n_trained"])[keep].astype(np.int64)
    if isinstance(fmt, PreferenceFormat):
        kept = encoded.select(keep)
        parts = np.asarray(kept.select_columns(["lengths"]).with_format("numpy")["lengths"], dtype=np.int64).reshape(-1, 3)
        kept = kept.select_columns([*PREFERENCE_COLUMNS, "n_trained"])
        return _Encoded(kept, lengths, trained, entry.weight, stats, parts)
    kept = encoded.select(keep).select_columns(["input_ids", "labels", "length", "n_trained"])
    return _Encoded(kept, lengths, trained, entry.weight, stats)


def _nothing_left(path: Path, key: str, stats: SourceStats, sequence_len: int) -> str:
    reasons = []
    if stats.bad_rows_skipped:
        reasons.append(f"{stats.bad_rows_skipped} bad rows skipped (first: {stats.skipped_examples[0]})")
    if stats.dropped_prompt_too_long:
        reasons.append(f"{stats.dropped_prompt_too_long} whose prompt alone fills data.sequence_len = {sequence_len} dropped")
    if stats.dropped_too_long:
        reasons.append(f"{stats.dropped_too_long} longer than data.sequence_len = {sequence_len} dropped")
    if stats.dropped_no_trained:
        reasons.append(f"{stats.dropped_no_trained} with no trained token dropped")
    return f"{path}: no usable rows ({key}): {stats.rows_read} rows read; " + "; ".join(reasons)


def _write_split(
    parts: list[_Encoded], selections: list[np.ndarray], seed: int, split_index: int, out: Path, sources: list[SourceStats]
) -> SplitStats:
    """Concatenate the selected rows of every part, shuffle, save; return the split's stats."""
    offsets = np.cumsum([0] + [len(p.dataset) for p in parts[:-1]])
    order = np.concatenate([offset + rows for offset, rows in zip(offsets, selections)]).astype(np.int64)
    order = order[mix.rng_for(seed, 3, split_index).permutation(len(order))]
    combined = datasets.concatenate_datasets([p.dataset for p in parts])
    pairs = parts[0].parts is not None
    columns = PREFERENCE_COLUMNS if pairs else OUTPUT_COLUMNS
    combined.select(order).select_columns(list(columns)).save_to_disk(str(out))
    lengths = np.concatenate([p.lengths for p in parts])[order]
    trained = np.concatenate([p.trained for p in parts])[order]
    lengths_3 = np.concatenate([p.parts for p in parts if p.parts is not None])[order] if pairs else None
    return SplitStats.from_arrays(lengths, trained, sources, lengths_3)


# ---------------------------------------------------------------- cache entries


def _load_entry(entry: Path, keep_in_memory: bool) -> tuple[datasets.Dataset, datasets.Dataset | None, DataStats] | None:
    """The datasets and stats of a complete entry, or None if it is absent or unreadable."""
    stats_file = entry / "stats.json"
    if not stats_file.is_file():
        return None
    try:
        stats = DataStats.from_json(stats_file.read_text(encoding="utf-8"))
        train = datasets.load_from_disk(str(entry / "train"), keep_in_memory=keep_in_memory)
        evaluation = None
        if (entry / "eval").is_dir():
            evaluation = datasets.load_from_disk(str(entry / "eval"), keep_in_memory=keep_in_memory)
    except Exception:  # noqa: BLE001 - any damage means "rebuild", never "crash"
        return None
    if list(train.column_names) not in (list(OUTPUT_COLUMNS), list(PREFERENCE_COLUMNS)):
        return None
    return train, evaluation, stats


def _relabel(stats: DataStats, cfg: HoneConfig) -> None:
    """Show the current paths: the key hashes contents, so a moved file still hits."""
    entries = [e for _, group in _sections(cfg) for e in group]
    for source, entry in zip(stats.sources, entries):
        source.path = str(entry.path)
