"""`hone bench` with ``data: lengths`` on CPU: padded vs packed rows count real trained tokens."""

import pytest

from hone.bench.harness import run_bench
from hone.bench.lengths import attention_span, document_lengths
from hone.bench.report import write_reports
from hone.bench.spec import parse_spec
from hone.config import ConfigError

pytestmark = pytest.mark.slow


def lengths_spec(**extra):
    raw = {
        "name": "tiny-lengths",
        "workload": {
            "preset": "tiny-llama",
            "sequence_len": 64,
            "micro_batch_size": 1,
            "dtype": "float32",
            "data": "lengths",
            "length_median": 10,
            "documents": 200,
        },
        "conditions": [
            {"name": "padded", "set": {"training.micro_batch_size": 2}},
            {"name": "packed", "set": {"data.sample_packing": True}},
        ],
        "warmup_steps": 1,
        "timed_steps": 3,
        "timeout_s": 300,
    }
    raw.update(extra)
    return parse_spec(raw)


def test_length_mix_is_seeded_and_clipped():
    w = lengths_spec().workload
    a, b = document_lengths(w, 3), document_lengths(w, 3)
    assert (a == b).all() and a.max() <= 64 and a.min() >= 8 and len(a) == 200
    assert not (a == document_lengths(w, 4)).all()
    assert attention_span(a) >= a.mean()


def test_reference_rows_are_refused_on_a_length_mix():
    with pytest.raises(ConfigError, match="remove the reference condition"):
        lengths_spec(conditions=[{"name": "ref", "reference": "hf-peft"}])


def test_packed_and_padded_rows_report_trained_tokens_per_second(tmp_path):
    spec = lengths_spec()
    rows = run_bench(spec, tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    padded, packed = rows
    assert packed["packing_efficiency"] > 0.9 and "packing_efficiency" not in padded
    for row in rows:  # every document's first token is untrained: trained < real tokens
        assert 0 < row["trained_tokens_per_s"] < row["tokens_per_s"]
    table, _ = write_reports(spec, rows, tmp_path)
    text = table.read_text()
    assert "| condition | trained tok/s | vs padded |" in text and "| packed |" in text and "1.00x" in text
    assert packed["trained_tokens_per_s_at_median"] > 0
