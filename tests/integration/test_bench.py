"""`hone bench` end to end on CPU: a tiny preset, reference vs hone, a failure; replicates with the
worker stubbed (each condition's process is ~13 s of imports on a 2-core machine)."""

import json
from pathlib import Path

import pytest

from hone.bench import harness
from hone.bench.harness import classify_failure, failure_log, run_bench
from hone.bench.report import write_reports
from hone.bench.spec import parse_spec
from hone.config import ConfigError

pytestmark = pytest.mark.slow


def tiny_spec(**extra):
    raw = {
        "name": "tiny",
        "workload": {"preset": "tiny-llama", "sequence_len": 32, "micro_batch_size": 2, "dtype": "float32"},
        "conditions": [
            {"name": "reference", "reference": "hf-peft"},
            {"name": "hone", "set": {"memory.gradient_checkpointing": True}},
            {"name": "broken", "set": {"training.micro_batch_size": 0}},
        ],
        "warmup_steps": 1,
        "timed_steps": 2,
        "replicates": 1,
        "timeout_s": 300,
    }
    raw.update(extra)
    return parse_spec(raw)


def test_bench_runs_conditions_and_writes_all_outputs(tmp_path):
    spec = tiny_spec()
    rows = run_bench(spec, tmp_path)
    assert [(r["condition"], r["replicate"]) for r in rows] == [("reference", 0), ("hone", 0), ("broken", 0)]
    ok = [r for r in rows if r["condition"] != "broken"]
    for row in ok:
        assert row["status"] == "ok", row.get("log_tail")
        assert row["median_ms"] > 0 and row["min_ms"] <= row["median_ms"] <= row["max_ms"]
        assert row["tokens_per_s"] > 0 and row["mfu_pct"] > 0
        assert row["final_loss"] == pytest.approx(row["final_loss"]) and 0 < row["final_loss"] < 20
        assert len(row["losses"]) == 3 and row["losses"][-1] == pytest.approx(row["final_loss"], abs=1e-4)
        assert len(row["step_ms"]) == 3 and row["max_ms"] == pytest.approx(max(row["step_ms"][-2:]), abs=0.06)
    hone_row = ok[1]  # what every auto took, values only: a defaults row names its setting
    assert hone_row["decided"]["cuda_graphs"] is False and hone_row["decided"]["checkpointing"] == "full"
    assert not any(key.endswith("_why") for key in hone_row["decided"]) and "decided" not in ok[0]
    broken = [r for r in rows if r["condition"] == "broken"]
    assert all(r["status"] == "error" and "micro_batch_size" in r["error"] for r in broken)
    # each failed row's whole stderr is kept beside the results (the row holds only its ends)
    assert [Path(r["log_file"]).name for r in broken] == ["broken-0.log"]
    assert all("micro_batch_size" in Path(r["log_file"]).read_text() for r in broken)
    assert not any("log_file" in r or "_whole_log" in r for r in ok)

    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["condition"] == "reference"
    table, chart = write_reports(spec, rows, tmp_path, command="hone bench tiny.yml")
    text = table.read_text()
    assert "| hone |" in text and "x |" in text and "broken | error" in text
    assert "speed-up vs reference" in text and "hone bench tiny.yml" in text
    assert chart.stat().st_size > 1000 and chart.read_bytes()[:4] == b"\x89PNG"


def test_replicates_run_each_condition_in_turn_and_every_row_is_appended_as_it_finishes(tmp_path, monkeypatch):
    def worker(spec_file, spec, condition, replicate, workdir):
        assert (len(results.read_text().splitlines()) if results.exists() else 0) == len(started)  # earlier rows on disk
        started.append((condition, replicate))
        return {"spec": spec.name, "condition": condition, "replicate": replicate, "status": "ok", "median_ms": 1.0}

    started, results = [], tmp_path / "results.jsonl"
    monkeypatch.setattr(harness, "run_one", worker)
    rows = run_bench(tiny_spec(replicates=2), tmp_path)
    want = [(c, r) for c in ("reference", "hone", "broken") for r in (0, 1)]
    assert started == want and [(r["condition"], r["replicate"]) for r in rows] == want
    assert [json.loads(line)["replicate"] for line in results.read_text().splitlines()] == [0, 1] * 3


def test_spec_rules():
    with pytest.raises(ConfigError, match="unique"):
        tiny_spec(conditions=[{"name": "a", "reference": "hf-peft"}, {"name": "a"}])
    with pytest.raises(ConfigError, match="reference options"):
        tiny_spec(conditions=[{"name": "a", "compile": True}])
    with pytest.raises(ConfigError, match="exactly one"):
        parse_spec({"workload": {}, "conditions": [{"name": "a"}]})


def test_failure_classification():
    assert classify_failure(1, "...\ntorch.OutOfMemoryError: CUDA out of memory. Tried")[0] == "oom"
    inductor = (
        'Traceback\n  File "select_algorithm.py", line 3335\n    raise NoValidChoicesError\n'
        "torch._inductor.exc.InductorError: NoValidChoicesError: \n\n"
        'Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace. For even more developer context, set TORCH_LOGS="+dynamo"\n'
    )
    assert classify_failure(1, inductor) == ("error", "torch._inductor.exc.InductorError: NoValidChoicesError:")
    assert classify_failure(3, "no traceback here\n") == ("error", "no traceback here")
    config = (
        "Traceback\nhone.config.errors.ConfigError: condition 'broken': 1 problem\n"
        "  - training.micro_batch_size: must be >= 1, got 0\n"
    )
    assert (
        classify_failure(1, config)[1]
        == "hone.config.errors.ConfigError: condition 'broken': 1 problem - training.micro_batch_size: must be >= 1, got 0"
    )
    status, reason = classify_failure(1, "Traceback\nValueError: boom\n")
    assert status == "error" and reason == "ValueError: boom"
    # torchrun: a rank's exception, its summary after it; the rank's exception is the cause
    ranks = (
        '[rank2]: Traceback (most recent call last):\n[rank2]:   File "loop.py", line 3\n'
        "RuntimeError: shapes do not match\n"
        'Traceback (most recent call last):\n  File "run.py", line 9\n'
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n====\nhone.bench.worker FAILED\n"
    )
    assert classify_failure(1, ranks) == ("error", "RuntimeError: shapes do not match")
    prefixed = ranks.replace("RuntimeError", "[rank0]: RuntimeError")  # torch's prefix on every rank line
    prefixed += "Root Cause (first observed failure):\n[0]:\n  exitcode  : 1\n=====\n"
    assert classify_failure(1, prefixed) == ("error", "RuntimeError: shapes do not match")
    assert failure_log(ranks).startswith('Traceback (most recent call last):\n  File "run.py"') is False
    assert "shapes do not match" in failure_log(ranks) and "FAILED" in failure_log(ranks)


def test_a_spec_may_time_the_first_step_for_the_longest_runs():
    """``warmup_steps: 0`` (one step of many minutes is all a session affords at the longest
    lengths) times the first step and says so in the table; a negative count is refused."""
    from hone.bench.report import markdown_table

    spec = tiny_spec(warmup_steps=0, timed_steps=1)
    assert spec.warmup_steps == 0
    assert "after 0 warm-up (the first step timed, compilation included)" in markdown_table(spec, [])
    assert "(the first step timed" not in markdown_table(tiny_spec(), [])
    with pytest.raises(ConfigError, match="warmup_steps"):
        tiny_spec(warmup_steps=-1)
