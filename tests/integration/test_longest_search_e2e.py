"""``hone bench`` kind longest end to end on CPU: each length a real worker process (a tiny
preset), rows with the length and the peak host memory, the table. Nothing is timed."""

import json

import pytest

from hone.cli import main

pytestmark = pytest.mark.slow

SPEC = """
name: tiny-longest
kind: longest
search: {start: 32, max: 64, granularity: 32, steps: 2}
workload: {preset: tiny-llama, sequence_len: 32, micro_batch_size: 1, dtype: float32}
timeout_s: 300
conditions:
  - name: hone
    set: {memory.activation_checkpointing: full}
"""


def test_longest_probes_each_length_in_its_own_process(tmp_path, capsys):
    spec = tmp_path / "spec.yml"
    spec.write_text(SPEC)
    assert main(["bench", str(spec), "--out", str(tmp_path / "out")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    probes = [r for r in rows if r["status"] != "summary"]
    assert [(r["sequence_len"], r["status"]) for r in probes] == [(32, "ok"), (64, "ok")], [r.get("log_tail") for r in probes]
    assert all(r["peak_host_gib"] > 0 and r["tokens_per_s"] > 0 for r in probes)
    summary = rows[-1]
    assert summary["status"] == "summary" and summary["longest"] == 64
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| hone | 64 |" in table and "peak host GiB" in table
    assert "longest 64 tokens" in capsys.readouterr().out
