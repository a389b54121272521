"""``kind: longest`` and ``kind: lengths``: benchmarks over the sequence length.

``longest`` finds, for every condition, the longest sequence that completes ``search.steps``
optimizer steps: it doubles from ``search.start`` while lengths complete, then bisects between
the last that completed and the first that failed down to ``search.granularity``
(:func:`find_longest`, pure: tested with a fake probe). ``lengths`` runs every condition at each
of a list of lengths. Every length of every condition is its own worker process (the harness's
:func:`hone.bench.harness.run_one`): an out-of-memory probe leaves nothing behind (no
fragmented allocator, no leaked pinned memory) for the next one. Each row records the length,
tok/s, the peak GPU memory and the peak host memory (resident set, pinned buffers included).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hone.bench.spec import BenchSpec

Probe = Callable[[int], bool]


def find_longest(probe: Probe, start: int, cap: int, granularity: int) -> tuple[int, list[tuple[int, bool]]]:
    """The longest length ``probe`` passes, searched from ``start`` up to ``cap``: doubling while
    it passes, then bisecting between the last pass and the first failure until they are
    ``granularity`` apart (lengths tried are multiples of ``granularity``, bar ``start`` and
    ``cap``). When ``start`` fails, the search bisects below it. Returns (longest, 0 when none
    passed; every (length, passed) in the order tried). Assumes a length that fails makes every
    longer one fail (memory grows with the length)."""
    if not 0 < start <= cap or granularity < 1:
        raise ValueError(f"need 0 < start <= cap and granularity >= 1, got start={start}, cap={cap}, granularity={granularity}")
    tried: list[tuple[int, bool]] = []

    def attempt(length: int) -> bool:
        passed = bool(probe(length))
        tried.append((length, passed))
        return passed

    good, bad = 0, None
    length = start
    while True:
        if not attempt(length):
            bad = length
            break
        good = length
        if length >= cap:
            return good, tried
        length = min(2 * length, cap)
    while bad - good > granularity:
        mid = (good + bad) // 2 // granularity * granularity
        if mid <= good:
            mid = good + granularity
        if mid >= bad:
            break
        if attempt(mid):
            good = mid
        else:
            bad = mid
    return good, tried


def at_length(spec: BenchSpec, length: int) -> BenchSpec:
    """``spec`` with every row ``length`` tokens long; a ``longest`` probe runs ``search.steps``
    steps (one warm-up, the rest timed)."""
    data = spec.model_dump(exclude_unset=True)
    data.setdefault("workload", {})["sequence_len"] = length
    if spec.kind == "longest":
        data["warmup_steps"] = 1
        data["timed_steps"] = spec.search.steps - 1
    return BenchSpec.model_validate(data)


RunOne = Callable[[Path, BenchSpec, str, int, Path], dict[str, Any]]


def run_by_length(
    spec: BenchSpec,
    out_dir: Path,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    run_one: RunOne | None = None,
) -> list[dict[str, Any]]:
    """Run a ``longest`` or ``lengths`` spec: one worker process per (condition, length); rows
    (each with ``sequence_len``; a ``longest`` condition's last row is its summary with
    ``longest``) are appended to ``out_dir/results.jsonl`` as they finish. ``run_one``: the
    harness's (tests pass a fake)."""
    from hone.bench import harness

    run = run_one or harness.run_one
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    env = harness.environment() if run_one is None else {}
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        harness.record_row(row, env, rows, results, on_row)

    with tempfile.TemporaryDirectory(prefix="hone-bench-") as tmp:
        workdir = Path(tmp)

        def probe_row(condition: str, length: int) -> dict[str, Any]:
            probe_spec = at_length(spec, length)
            spec_file = workdir / f"spec-{length}.json"
            spec_file.write_text(probe_spec.model_dump_json(exclude_unset=True))
            row = run(spec_file, probe_spec, condition, 0, workdir)
            row["sequence_len"] = length
            record(row)
            return row

        for condition in spec.conditions:
            if spec.kind == "lengths":
                for length in spec.lengths:
                    probe_row(condition.name, length)
                continue
            s = spec.search
            longest, tried = find_longest(lambda n: probe_row(condition.name, n)["status"] == "ok", s.start, s.max, s.granularity)
            record(
                {
                    "spec": spec.name,
                    "condition": condition.name,
                    "kind": condition.reference or "hone",
                    "status": "summary",
                    "longest": longest,
                    "tried": tried,
                    "steps": s.steps,
                }
            )
    return rows


def _one_decimal(value: Any) -> str:
    """A number of GiB as a table cell (blank when not measured)."""
    return "" if value is None else f"{value:.1f}"


def lengths_markdown(
    spec: BenchSpec, rows: list[dict[str, Any]], env: dict[str, Any] | None = None, command: str | None = None
) -> str:
    """The table of a ``longest``/``lengths`` run: per condition and length, the outcome, ms per
    step, tok/s (and its share of the condition's shortest completed length's), peak GPU memory
    (measured and estimated) and peak host memory; for ``longest``, the longest per condition."""
    from hone.bench.report import _describe, _provenance

    w = spec.workload
    model, adapter = _describe(w)
    how = (
        f"longest sequence completing {spec.search.steps} optimizer steps: doubling from {spec.search.start:,}, "
        f"bisecting to {spec.search.granularity:,}, at most {spec.search.max:,}"
        if spec.kind == "longest"
        else f"lengths {', '.join(f'{n:,}' for n in spec.lengths)}; "
        f"median of {spec.timed_steps} steps after {spec.warmup_steps} warm-up"
    )
    lines = [
        f"### {spec.name}",
        "",
        f"{model}; micro-batch {w.micro_batch_size}; {w.dtype}; {adapter}; random tokens; {how}. "
        "Every length of every condition is a fresh process. "
        "Host GiB: the process's peak resident memory (pinned buffers included).",
    ]
    lines += _provenance(env, command)
    summaries = {r["condition"]: r for r in rows if r.get("status") == "summary"}
    if summaries:
        lines += ["", "| condition | longest sequence | lengths tried (ok / failed) |", "|---|---|---|"]
        for name, s in summaries.items():
            tried = ", ".join(f"{n:,} {'ok' if ok else 'failed'}" for n, ok in s["tried"])
            lines.append(f"| {name} | {s['longest']:,} | {tried} |" if s["longest"] else f"| {name} | none | {tried} |")
    lines += [
        "",
        "| condition | seq | status | ms/step | tok/s | tok/s vs shortest | peak GPU GiB | estimated GiB | peak host GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for condition in spec.conditions:
        mine = sorted(
            (r for r in rows if r["condition"] == condition.name and r.get("status") != "summary"),
            key=lambda r: r["sequence_len"],
        )
        ok = [r for r in mine if r.get("status") == "ok"]
        base = ok[0]["tokens_per_s"] if ok else None
        for r in mine:
            if r.get("status") != "ok":
                lines.append(
                    f"| {condition.name} | {r['sequence_len']:,} | {r.get('status')}: {r.get('error', '')} |  |  |  |  |  |  |"
                )
                continue
            share = f"{100 * r['tokens_per_s'] / base:.0f}%" if base else ""
            lines.append(
                f"| {condition.name} | {r['sequence_len']:,} | ok | {r['median_ms']:.0f} | {r['tokens_per_s']:,.0f} | {share} | "
                f"{_one_decimal(r.get('peak_alloc_gib'))} | {_one_decimal(r.get('estimated_peak_gib'))} | "
                f"{_one_decimal(r.get('peak_host_gib'))} |"
            )
    return "\n".join(lines) + "\n"


def write_lengths_report(spec: BenchSpec, rows: list[dict[str, Any]], out_dir: Path, command: str | None = None) -> Path:
    """``out_dir/results.md`` for a ``longest``/``lengths`` run."""
    from hone.atomic import atomic_write_text

    env = next((r.get("env") for r in rows if r.get("env")), None)
    path = out_dir / "results.md"
    atomic_write_text(path, lengths_markdown(spec, rows, env, command))
    return path
