"""The markdown table and bar chart of a benchmark, with ratios to the reference."""

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hone.atomic import atomic_write_text, atomic_write_with
from hone.bench.spec import BenchSpec
from hone.transforms.watch import GRAPH_WARMUP_STEPS


def summarise(spec: BenchSpec, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per condition: medians over the replicates that succeeded."""
    out = []
    for condition in spec.conditions:
        mine = [r for r in rows if r["condition"] == condition.name]
        ok = [r for r in mine if r.get("status") == "ok"]
        entry: dict[str, Any] = {
            "condition": condition.name,
            "kind": condition.reference or "hone",
            "runs": len(mine),
            "ok": len(ok),
        }
        if ok:
            for key in (
                "median_ms",
                "min_ms",
                "max_ms",
                "first_step_s",
                "tokens_per_s",
                "trained_tokens_per_s",
                "peak_alloc_gib",
                "estimated_peak_gib",
                "peak_reserved_gib",
                "peak_host_gib",
                "alloc_retries",
                "mfu_pct",
                "final_loss",
                "packing_efficiency",
                "trained_tokens_per_s_at_median",
                "tokens_per_s_per_gpu",
                "scaling",
                "scaling_per_gpu",
                "peak_vs_one",
                "pairs_per_s",
            ):
                values = [r[key] for r in ok if r.get(key) is not None]
                entry[key] = statistics.median(values) if values else None
            entry["min_ms"] = min(r["min_ms"] for r in ok)
            entry["max_ms"] = max(r["max_ms"] for r in ok)
            entry["graph_recordings_after_warmup"] = max(
                (r.get("compile") or {}).get("graph_recordings_after_warmup") or 0 for r in ok
            )
            entry["first_timed_ratio"] = max((_first_timed_ratio(r, spec.warmup_steps) for r in ok), default=None)
            # Throughput and MFU follow the aggregated step time, so a row is self-consistent.
            scale = ok[0]["median_ms"] / entry["median_ms"]
            entry["tokens_per_s"] = ok[0]["tokens_per_s"] * scale
            entry["trained_tokens_per_s"] = ok[0]["trained_tokens_per_s"] * scale
            entry["mfu_pct"] = ok[0]["mfu_pct"] * scale
            if ok[0].get("pairs_per_s") is not None:
                entry["pairs_per_s"] = ok[0]["pairs_per_s"] * scale
            entry["nproc"] = condition.nproc
        else:
            failed = mine[0] if mine else {}
            entry["status"] = failed.get("status", "missing")
            entry["error"] = failed.get("error", "")
        out.append(entry)
    return out


def baseline_of(summary: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first reference condition that ran; every row's ratio is against it."""
    return next((s for s in summary if s["kind"] != "hone" and s["ok"]), None)


def _fmt(value: Any, spec: str = "") -> str:
    return "" if value is None else format(value, spec)


def _describe(w: Any) -> tuple[str, str]:
    """(model, adapter) phrases for a table's heading."""
    model = w.preset or str(w.path)
    if w.layers:
        model += f", {w.layers} layers"
    if w.adapter.type == "lora":
        return model, f"LoRA r={w.adapter.lora_r} on {','.join(w.adapter.lora_target_modules)}"
    return model, "full fine-tune"


def _provenance(env: dict[str, Any] | None, command: str | None) -> list[str]:
    """The card, the versions and the command: what a reader needs to reproduce a table."""
    lines = []
    if env:
        lines.append(
            f"Device: {env.get('device')}; torch {env.get('torch')}, "
            f"transformers {env.get('transformers')}, peft {env.get('peft')}"
            + (f", trl {env['trl']}." if env.get("trl") else ".")
        )
    if command:
        lines += ["", f"Command: `{command}`"]
    return lines


def markdown_table(
    spec: BenchSpec, summary: list[dict[str, Any]], env: dict[str, Any] | None = None, command: str | None = None
) -> str:
    w = spec.workload
    if w.data == "lengths":
        return _lengths_table(spec, summary, env, command)
    base = baseline_of(summary)
    model, adapter = _describe(w)
    pairs = w.data == "pairs"
    data = (
        f"{w.objective.upper()} on pairs of a {w.prompt_len}-token prompt and two {w.completion_len}-token completions "
        f"({w.prompt_len + 2 * w.completion_len} tokens a pair), micro-batch {w.micro_batch_size} pair(s) x accum "
        f"{w.gradient_accumulation_steps}; tok/s counts both sequences of a pair"
        if pairs
        else f"seq {w.sequence_len}; micro-batch {w.micro_batch_size} x accum {w.gradient_accumulation_steps}"
    )
    lines = [
        f"### {spec.name}",
        "",
        f"{model}; {data}; {w.dtype}; {adapter}; random tokens. Median of {spec.timed_steps} steps after "
        f"{spec.warmup_steps} warm-up{' (the first step timed, compilation included)' if not spec.warmup_steps else ''}, "
        f"{spec.replicates} process(es) per condition; MFU vs {spec.peak_tflops:g} TFLOP/s.",
    ]
    lines += _provenance(env, command)
    ref_name = base["condition"] if base else "reference"
    multi = any(c.nproc > 1 for c in spec.conditions)
    lines += [
        "",
        f"| condition | ms/step (min-max) | speed-up vs {ref_name} | {'pairs/s | ' if pairs else ''}tok/s | peak alloc GiB | "
        "estimated GiB | "
        "peak host GiB | MFU | first step s | last loss |"
        + (" GPUs | tok/s per GPU | scaling vs 1 GPU | per GPU vs 1 GPU | peak vs 1 GPU |" if multi else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if pairs else "") + ("---|---|---|---|---|" if multi else ""),
    ]
    if multi:
        lines.insert(
            4, "Multi-GPU rows: tok/s is the total over the ranks, ms/step the slowest rank's, peak memory the fullest rank's."
        )
    for s in summary:
        if not s["ok"]:
            lines.append(f"| {s['condition']} | {s['status']}: {s['error']} | | | | | | | | |")
            continue
        ratio = f"{base['median_ms'] / s['median_ms']:.2f}x" if base else ""
        lines.append(
            f"| {s['condition']} | {s['median_ms']:.1f} ({s['min_ms']:.1f}-{s['max_ms']:.1f}) | {ratio} | "
            + (f"{_fmt(s.get('pairs_per_s'), '.2f')} | " if pairs else "")
            + f"{s['tokens_per_s']:,.0f} | {_fmt(s['peak_alloc_gib'], '.1f')} | {_fmt(s.get('estimated_peak_gib'), '.1f')} | "
            f"{_fmt(s.get('peak_host_gib'), '.1f')} | {_fmt(s['mfu_pct'], '.1f')}% | "
            f"{s['first_step_s']:.2f} | {_fmt(s['final_loss'], '.3f')} |"
            + (
                f" {s.get('nproc', 1)} | {s.get('tokens_per_s_per_gpu') or s['tokens_per_s']:,.0f} | "
                f"{_ratio(s.get('scaling'))} | {_ratio(s.get('scaling_per_gpu'))} | {_share(s.get('peak_vs_one'))} |"
                if multi
                else ""
            )
        )
    lines += _notes(summary, spec.warmup_steps)
    return "\n".join(lines) + "\n"


def _ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else ""


def _share(value: float | None) -> str:
    return f"{value:.0%}" if value else ""


def _row_notes(
    summary: list[dict[str, Any]], flagged: Callable[[dict[str, Any]], bool], says: Callable[[dict[str, Any]], str]
) -> list[str]:
    """Lines under the table, one per row that ran and is ``flagged``, each ``- condition: says``
    (after a blank line; none without such a row)."""
    notes = [f"- {s['condition']}: {says(s)}" for s in summary if s["ok"] and flagged(s)]
    return ["", *notes] if notes else []


def _notes(summary: list[dict[str, Any]], warmup_steps: int) -> list[str]:
    """The rows whose time says less than it seems: the card was full (the caching allocator freed
    its cache and retried, each retry waiting for the device: the time says more about the memory
    limit than about the settings); CUDA graphs were recorded again after their warm-up (their
    inputs move, :class:`hone.transforms.watch.CompileWatch`: the row times recordings, not
    replays); the first timed step was still warming up (the median leans on it)."""
    return (
        _row_notes(
            summary,
            lambda s: s.get("alloc_retries"),
            lambda s: (
                f"the CUDA caching allocator retried {s['alloc_retries']:.0f} allocation(s) at the card's limit "
                "(each waits for the device)"
            ),
        )
        + _row_notes(
            summary,
            lambda s: s.get("graph_recordings_after_warmup"),
            lambda s: (
                f"CUDA graphs were recorded {s['graph_recordings_after_warmup']} time(s) after the first "
                f"{GRAPH_WARMUP_STEPS} steps (recorded again, not replayed: each recording waits for the device)"
            ),
        )
        + _row_notes(
            summary,
            lambda s: (s.get("first_timed_ratio") or 0) > SLOW_FIRST_TIMED,
            lambda s: (
                f"its first timed step took {s['first_timed_ratio']:.2f}x the other timed steps' median: still "
                f"warming up after {warmup_steps} warm-up step(s) (raise warmup_steps; the median leans on it)"
            ),
        )
    )


#: A first timed step this much slower than the other timed steps' median was still warming up.
SLOW_FIRST_TIMED = 1.5


def _first_timed_ratio(row: dict[str, Any], warmup_steps: int) -> float:
    """The first timed step's time over the median of the other timed ones (0.0 with fewer than
    three timed steps): where it is well above 1 the warm-up ended too early for this row (a CUDA
    graph still recording, a late compile) and the median leans on a warm-up step."""
    timed = (row.get("step_ms") or [])[warmup_steps:]
    return timed[0] / statistics.median(timed[1:]) if len(timed) >= 3 else 0.0


def _lengths_table(spec: BenchSpec, summary: list[dict[str, Any]], env: dict[str, Any] | None, command: str | None) -> str:
    """Batching conditions on a length mix: steps differ in size, so compare trained tokens/s
    (ratios to the first condition that ran), not ms/step: over all timed steps (stalls
    included), and mean trained tokens per step over the median step time (the steady state)."""
    w = spec.workload
    model, adapter = _describe(w)
    lines = [
        f"### {spec.name}",
        "",
        f"{model}; sequence_len {w.sequence_len}; micro-batch {w.micro_batch_size} x accum {w.gradient_accumulation_steps} "
        f"unless a condition sets otherwise; {w.dtype}; {adapter}; {w.documents} documents of random tokens, log-normal "
        f"lengths (median {w.length_median}, sigma {w.length_sigma:g}, clipped to {w.sequence_len}). Throughput over "
        f"{spec.timed_steps} steps after {spec.warmup_steps} warm-up; MFU vs {spec.peak_tflops:g} TFLOP/s with attention "
        "FLOPs of the documents' own lengths.",
    ]
    lines += _provenance(env, command)
    base = next((s for s in summary if s["ok"]), None)
    ref_name = base["condition"] if base else "first row"
    lines += [
        "",
        f"| condition | trained tok/s | vs {ref_name} | trained tok/s at the median step | vs {ref_name} | real tok/s | "
        "ms/step (min-max) | packing efficiency | peak alloc GiB | estimated GiB | MFU | first step s | last loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        if not s["ok"]:
            lines.append(f"| {s['condition']} | {s['status']}: {s['error']} | | | | | | | | | | | |")
            continue
        ratio = f"{s['trained_tokens_per_s'] / base['trained_tokens_per_s']:.2f}x" if base else ""
        at_median = s.get("trained_tokens_per_s_at_median")
        base_median = base.get("trained_tokens_per_s_at_median") if base else None
        median_ratio = f"{at_median / base_median:.2f}x" if at_median and base_median else ""
        eff = f"{100 * s['packing_efficiency']:.1f}%" if s.get("packing_efficiency") is not None else ""
        lines.append(
            f"| {s['condition']} | {s['trained_tokens_per_s']:,.0f} | {ratio} | {_fmt(at_median, ',.0f')} | {median_ratio} | "
            f"{s['tokens_per_s']:,.0f} | "
            f"{s['median_ms']:.1f} ({s['min_ms']:.1f}-{s['max_ms']:.1f}) | {eff} | {_fmt(s['peak_alloc_gib'], '.1f')} | "
            f"{_fmt(s.get('estimated_peak_gib'), '.1f')} | "
            f"{_fmt(s['mfu_pct'], '.1f')}% | {s['first_step_s']:.2f} | {_fmt(s['final_loss'], '.3f')} |"
        )
    return "\n".join(lines) + "\n"


def bar_chart(summary: list[dict[str, Any]], path: Path, title: str, trained_tokens: bool = False) -> None:
    """ms/step per condition, or trained tokens/s where steps differ in size (a length mix:
    a short padded step is fast and trains little); failures are empty bars with their status.
    Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, unit, axis = (
        ("trained_tokens_per_s", "tok/s", "trained tokens per second (higher is better)")
        if trained_tokens
        else ("median_ms", "ms", "ms per optimizer step (lower is better)")
    )
    names = [s["condition"] for s in summary]
    values = [(s.get(key) or 0.0) if s["ok"] else 0.0 for s in summary]
    colors = ["#888888" if s["kind"] != "hone" else "#2a7ab0" for s in summary]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(names) + 1.5))
    bars = ax.barh(names, values, color=colors)
    for bar, s, value in zip(bars, summary, values):
        label = f"{value:,.{0 if trained_tokens else 1}f} {unit}" if s["ok"] else s.get("status", "failed")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {label}", va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel(axis)
    ax.set_title(title)
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def write_reports(spec: BenchSpec, rows: list[dict[str, Any]], out_dir: Path, command: str | None = None) -> tuple[Path, Path]:
    summary = summarise(spec, rows)
    env = rows[0].get("env") if rows else None
    table = out_dir / "table.md"
    atomic_write_text(table, markdown_table(spec, summary, env, command))
    chart = out_dir / "chart.png"
    bar_chart(summary, chart, spec.name, trained_tokens=spec.workload.data == "lengths")
    return table, chart
