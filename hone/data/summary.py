"""A plain-text summary of prepared data, for ``hone preprocess`` and the start of training.

Plain text (no colour codes) so it reads the same in a terminal, a log file and a test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hone.data.stats import DataStats, LengthBin, SplitStats

if TYPE_CHECKING:
    from hone.data.prepare import PreparedData

BAR_WIDTH = 40


def render_summary(prepared: PreparedData) -> str:
    stats = prepared.stats
    unit = "pairs" if stats.train.pairs else "rows"
    lines = [
        f"data: {_n(stats.train.rows)} train {unit}"
        + (f", {_n(stats.eval.rows)} eval {unit}" if stats.eval else ", no eval split")
    ]
    lines += _pair_table(stats) if stats.train.pairs else _split_table(stats)
    lines += _drops(stats)
    for split, packed in (prepared.packing or {}).items():
        lines.append(
            f"sample packing ({split}): {_n(packed.rows)} rows -> {_n(packed.num_bins)} packed rows of "
            f"{packed.capacity} tokens, {100 * packed.efficiency:.1f}% of token slots real"
        )
    lines.append("per file:")
    for source in stats.sources:
        used = f"train {_n(source.rows_train)}" if source.split == "train" else ""
        if source.rows_eval:
            used = f"{used}, eval {_n(source.rows_eval)}" if used else f"eval {_n(source.rows_eval)}"
        lines.append(
            f"  {source.path} ({source.type}, weight {source.weight:g}): {_n(source.rows_read)} read, "
            f"{_n(source.rows_kept)} kept -> {used or 'nothing used'}"
        )
        for example in source.skipped_examples:
            lines.append(f"    skipped: {example}")
        for example in source.dropped_examples:
            lines.append(f"    dropped: {example}")
    per = "tokens per pair: prompt + the longer completion" if stats.train.pairs else "tokens per row"
    lines.append(f"length histogram (train, {per}, sequence_len {stats.sequence_len}):")
    lines += _histogram(stats.train.histogram)
    if prepared.cache_enabled:
        lines.append(f"cache: {prepared.cache_dir} ({'hit' if prepared.cache_hit else 'written'})")
    else:
        lines.append("cache: not used (--no-cache)")
    return "\n".join(lines)


def _n(value: int) -> str:
    return f"{value:,}"


def _split_table(stats: DataStats) -> list[str]:
    header = f"  {'':<6}{'rows':>10}{'tokens':>12}{'trained':>12}{'mean len':>10}{'max len':>9}"
    rows = [header]
    splits: list[tuple[str, SplitStats | None]] = [("train", stats.train), ("eval", stats.eval)]
    for name, split in splits:
        if split is None:
            continue
        rows.append(
            f"  {name:<6}{_n(split.rows):>10}{_n(split.tokens):>12}{_n(split.trained_tokens):>12}"
            f"{split.mean_length:>10.1f}{split.max_length:>9}"
        )
    return rows


def _pair_table(stats: DataStats) -> list[str]:
    """Pairs and the mean / max length of their prompts and of each completion."""
    header = f"  {'':<6}{'pairs':>10}{'prompt mean':>13}{'max':>7}{'chosen mean':>13}{'max':>7}{'rejected mean':>15}{'max':>7}"
    rows = [header]
    splits: list[tuple[str, SplitStats | None]] = [("train", stats.train), ("eval", stats.eval)]
    for name, split in splits:
        if split is None:
            continue
        count = split.rows or 1
        rows.append(
            f"  {name:<6}{_n(split.rows):>10}{split.prompt_tokens / count:>13.1f}{split.max_prompt:>7}"
            f"{split.chosen_tokens / count:>13.1f}{split.max_chosen:>7}"
            f"{split.rejected_tokens / count:>15.1f}{split.max_rejected:>7}"
        )
    train = stats.train
    if train.rows:
        # training.preference.share_prompt: the prompt once (and its last token again in the second branch)
        shared = (train.prompt_tokens + train.chosen_tokens + train.rejected_tokens + train.rows) / train.rows
        twice = (2 * train.prompt_tokens + train.chosen_tokens + train.rejected_tokens) / train.rows
        rows.append(
            f"  a train pair is {shared:.1f} tokens with its prompt shared (training.preference.share_prompt), "
            f"{twice:.1f} with the prompt in both sequences ({1 - shared / twice:.0%} fewer)"
        )
    return rows


def _drops(stats: DataStats) -> list[str]:
    too_long = sum(s.dropped_too_long for s in stats.sources)
    no_trained = sum(s.dropped_no_trained for s in stats.sources)
    skipped = sum(s.bad_rows_skipped for s in stats.sources)
    truncated = sum(s.truncated for s in stats.sources)
    prompt_long = sum(s.dropped_prompt_too_long for s in stats.sources)
    if stats.train.pairs:
        return [
            f"dropped: {_n(prompt_long)} pairs whose prompt alone fills {stats.sequence_len} tokens, "
            f"{_n(too_long)} longer than {stats.sequence_len} tokens"
            f"{' (strategy: drop)' if stats.excess_length_strategy == 'drop' else ''}; skipped: {_n(skipped)} bad rows; "
            f"truncated: {_n(truncated)} (completions cut to fit)"
        ]
    return [
        f"dropped: {_n(too_long)} longer than {stats.sequence_len} tokens"
        f"{' (strategy: drop)' if stats.excess_length_strategy == 'drop' else ''}, "
        f"{_n(no_trained)} with no trained token; skipped: {_n(skipped)} bad rows; "
        f"truncated: {_n(truncated)}"
    ]


def _histogram(bins: list[LengthBin]) -> list[str]:
    if not bins:
        return ["  (empty)"]
    peak = max(b.count for b in bins) or 1
    label_width = max(len(f"{b.lo}-{b.hi}") for b in bins)
    out = []
    for b in bins:
        bar = "#" * (round(BAR_WIDTH * b.count / peak) if b.count else 0)
        out.append(f"  {f'{b.lo}-{b.hi}':>{label_width}} | {bar:<{BAR_WIDTH}} {_n(b.count)}")
    return out
