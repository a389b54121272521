"""`hone bench` with ``reference: trl-dpo`` rows on CPU: TRL's DPOTrainer (through the peer
script) trains the ``data: pairs`` workload in the bench worker and lands in the table with
pairs/s, as hone's rows do. (hone's own preference rows need training.objective.)"""

import pytest

from hone.bench.harness import run_bench
from hone.bench.report import write_reports
from hone.bench.spec import parse_spec

pytestmark = pytest.mark.slow


def test_trl_dpo_rows_run_and_report_pairs_per_second(tmp_path):
    pytest.importorskip("trl")
    spec = parse_spec(
        {
            "name": "tiny-dpo",
            "workload": {
                "preset": "tiny-qwen3",
                "sequence_len": 48,
                "dtype": "float32",
                "data": "pairs",
                "prompt_len": 20,
                "completion_len": 12,
            },
            "conditions": [
                {"name": "TRL", "reference": "trl-dpo"},
                {"name": "TRL, checkpointing", "reference": "trl-dpo", "gradient_checkpointing": True},
            ],
            "warmup_steps": 1,
            "timed_steps": 2,
            "timeout_s": 300,
        }  # fmt: skip
    )
    rows = run_bench(spec, tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    for row in rows:
        assert row["kind"] == "trl-dpo" and row["pairs_per_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(row["pairs_per_s"] * 2 * (20 + 12), rel=1e-2)
        assert 0.6 < row["final_loss"] < 0.8  # DPO's log(2) at the start
    table, _ = write_reports(spec, rows, tmp_path)
    text = table.read_text()
    assert "| pairs/s | tok/s |" in text and ", trl 1.16" in text
