"""``hone bench`` over the sequence length: the search for the longest sequence (a fake probe:
nothing is run or timed), one process per length (a fake ``run_one``), the table, the specs."""

import json
from pathlib import Path

import pytest

from hone.bench.longest import at_length, find_longest, lengths_markdown, run_by_length
from hone.bench.spec import parse_spec
from hone.bench.worker import peak_host_gib
from hone.config.errors import ConfigError

K = 1024


def _probe(limit):
    return lambda n: n <= limit


@pytest.mark.parametrize("limit", [16 * K, 24 * K, 100 * K, 300 * K, 511 * K, 512 * K, 10**9])
def test_doubling_then_bisecting_finds_the_limit_to_the_granularity(limit):
    longest, tried = find_longest(_probe(limit), 16 * K, 512 * K, 8 * K)
    assert longest <= limit and longest <= 512 * K
    assert longest == min(limit, 512 * K) // (8 * K) * (8 * K)  # within one granule, on the grid
    failed = [n for n, ok in tried if not ok]
    assert all(n > limit for n in failed) and all(n <= limit for n, ok in tried if ok)
    assert len(tried) == len({n for n, _ in tried})  # no length twice
    assert tried[: min(len(tried), 2)][0] == (16 * K, True)


def test_the_search_order_is_doubling_then_bisecting():
    _, tried = find_longest(_probe(40 * K), 16 * K, 512 * K, 8 * K)
    assert [n // K for n, _ in tried] == [16, 32, 64, 48, 40]


def test_a_failing_start_bisects_below_it():
    longest, tried = find_longest(_probe(9 * K), 16 * K, 512 * K, 4 * K)
    assert tried[0] == (16 * K, False) and longest == 8 * K
    assert find_longest(_probe(0), 16 * K, 512 * K, 8 * K)[0] == 0


def test_bad_search_arguments():
    with pytest.raises(ValueError, match="start"):
        find_longest(_probe(1), 0, 8, 1)
    with pytest.raises(ValueError, match="start"):
        find_longest(_probe(1), 16, 8, 1)


SPEC = {
    "name": "t",
    "workload": {"preset": "tiny-llama", "sequence_len": 64},
    "conditions": [
        {"name": "ref", "reference": "hf-peft"},
        {"name": "hone", "set": {"memory.activation_checkpointing": "offload"}},
    ],
}


def test_spec_kinds_validate():
    longest = parse_spec({**SPEC, "kind": "longest", "search": {"start": 64, "max": 1024, "granularity": 64}})
    assert longest.search.steps == 3
    probe = at_length(longest, 512)
    assert probe.workload.sequence_len == 512 and (probe.warmup_steps, probe.timed_steps) == (1, 2)
    lengths = parse_spec({**SPEC, "kind": "lengths", "lengths": [64, 128]})
    assert at_length(lengths, 128).timed_steps == lengths.timed_steps
    for bad, words in [
        ({"kind": "lengths"}, "kind: lengths needs lengths"),
        ({"lengths": [64]}, "only read by kind: lengths"),
        ({"kind": "longest", "search": {"start": 2048, "max": 1024}}, "beyond search.max"),
        ({"kind": "lengths", "lengths": [4]}, "at least 8"),
    ]:
        with pytest.raises(ConfigError, match=words):
            parse_spec({**SPEC, **bad})


def _fake_run_one(limits):
    """A run_one whose rows complete up to ``limits[condition]`` tokens, then run out of memory."""
    calls = []

    def run_one(spec_file, spec, condition, replicate, workdir):
        written = json.loads(spec_file.read_text())
        n = spec.workload.sequence_len
        assert written["workload"]["sequence_len"] == n  # the worker reads this spec
        calls.append((condition, n))
        if n > limits[condition]:
            return {"condition": condition, "status": "oom", "error": "out of memory"}
        return {
            "condition": condition,
            "status": "ok",
            "median_ms": n / 10,
            "tokens_per_s": 10_000.0 * (1 - n / 4096),
            "peak_alloc_gib": n / 100,
            "estimated_peak_gib": n / 99,
            "peak_host_gib": 7.5,
        }

    return run_one, calls


def test_longest_runs_one_process_per_length_and_writes_the_table(tmp_path):
    spec = parse_spec({**SPEC, "kind": "longest", "search": {"start": 128, "max": 2048, "granularity": 64}})
    run_one, calls = _fake_run_one({"ref": 200, "hone": 1500})
    rows = run_by_length(spec, tmp_path, run_one=run_one)
    summary = {r["condition"]: r for r in rows if r["status"] == "summary"}
    assert summary["ref"]["longest"] == 192 and summary["hone"]["longest"] == 1472
    assert [n for c, n in calls if c == "ref"] == [128, 256, 192]
    saved = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(saved) == len(rows) == len(calls) + 2
    text = lengths_markdown(spec, rows)
    assert "| ref | 192 |" in text and "| hone | 1,472 |" in text
    assert "| hone | 1,024 | ok |" in text and "| ref | 256 | oom: out of memory |" in text
    assert "peak host GiB" in text and "| 7.5 |" in text


def test_lengths_kind_runs_every_length_and_compares_tok_s_to_the_shortest(tmp_path):
    spec = parse_spec({**SPEC, "kind": "lengths", "lengths": [512, 1024, 2048], "conditions": [SPEC["conditions"][1]]})
    run_one, calls = _fake_run_one({"hone": 1024})
    rows = run_by_length(spec, tmp_path, run_one=run_one)
    assert calls == [("hone", 512), ("hone", 1024), ("hone", 2048)]
    assert not any(r["status"] == "summary" for r in rows)
    text = lengths_markdown(spec, rows)
    # tok/s at 1024 over tok/s at 512: (1 - 1024/4096) / (1 - 512/4096)
    assert f"| {100 * 0.75 / 0.875:.0f}% |" in text and "| hone | 2,048 | oom" in text


def test_peak_host_memory_is_reported():
    peak = peak_host_gib()
    assert peak is None or 0 < peak < 4096


def test_a_failed_probe_keeps_its_whole_log_beside_the_results_not_in_them(tmp_path):
    """Every recorded row goes through ``record_row``: a length probe's whole stderr is written
    under ``logs/`` (named by its length, so probes do not overwrite each other), never into
    results.jsonl."""
    from hone.bench.harness import record_row

    results = tmp_path / "results.jsonl"
    rows: list[dict] = []
    for length in (200, 400):
        row = {"condition": "hone, 1 GPU", "replicate": 0, "sequence_len": length, "status": "oom", "_whole_log": f"log {length}"}
        record_row(row, {}, rows, results, None)
    assert [Path(r["log_file"]).name for r in rows] == ["hone-1-gpu-200-0.log", "hone-1-gpu-400-0.log"]
    assert [Path(r["log_file"]).read_text() for r in rows] == ["log 200", "log 400"]
    assert "_whole_log" not in results.read_text()
