"""The lines ``hone bench`` writes under its table for rows whose time says less than it seems:
CUDA graphs recorded again after their warm-up, a first timed step still warming up."""

from hone.bench.report import markdown_table, summarise
from hone.bench.spec import parse_spec


def _table(conditions: dict[str, dict], warmup_steps: int = 2) -> str:
    spec = parse_spec(
        {
            "name": "t",
            "workload": {"preset": "tiny-llama"},
            "conditions": [{"name": name} for name in conditions],
            "warmup_steps": warmup_steps,
        },
        "test",
    )
    rows = [
        {"condition": name, "replicate": 0, "status": "ok", "median_ms": 400.0, "min_ms": 400.0, "max_ms": 400.0,
         "first_step_s": 1.0, "tokens_per_s": 1.0, "trained_tokens_per_s": 1.0, "mfu_pct": 1.0, "final_loss": 1.0,
         "peak_alloc_gib": 39.0, **fields}
        for name, fields in conditions.items()
    ]  # fmt: skip
    return markdown_table(spec, summarise(spec, rows))


def test_a_row_whose_cuda_graphs_were_recorded_again_is_noted():
    table = _table(
        {
            "replayed": {"compile": {"graph_recordings": 2, "graph_recordings_after_warmup": 0}},
            "re-recorded": {"compile": {"graph_recordings": 98, "graph_recordings_after_warmup": 96}},
        }
    )
    assert "- re-recorded: CUDA graphs were recorded 96 time(s) after the first 3 steps" in table
    assert "- replayed:" not in table


def test_a_row_whose_first_timed_step_was_still_warming_up_is_noted():
    """The one-GPU MoE row of session 30: steps 26 s, 5.3 s, then 614 ms and three at ~350 ms
    with 2 warm-up steps; a row whose timed steps vary by less than half is not noted, nor one
    with too few timed steps to tell."""
    table = _table(
        {
            "warming": {"step_ms": [26383.6, 5347.0, 613.7, 348.9, 351.2, 358.6]},
            "steady": {"step_ms": [35003.5, 8667.1, 405.7, 399.6, 403.6, 400.3]},
            "short": {"step_ms": [30000.0, 5000.0, 900.0, 400.0]},
        }
    )
    assert "- warming: its first timed step took 1.75x the other timed steps' median" in table
    assert "after 2 warm-up step(s)" in table
    assert "- steady:" not in table and "- short:" not in table
    assert "- warming:" not in _table({"warming": {"step_ms": [26383.6, 5347.0, 613.7, 348.9, 351.2, 358.6]}}, 3)
