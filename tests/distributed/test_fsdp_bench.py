"""``nproc`` bench conditions: refused beyond the visible GPUs, launched by torchrun, merged rows."""

from pathlib import Path

import pytest

from hone.bench.harness import BenchNprocError, add_scaling, check_nproc, merge_ranks, worker_command
from hone.bench.spec import parse_spec

SPEC = {
    "workload": {"preset": "tiny-llama", "sequence_len": 64, "adapter": {"type": "lora"}},
    "conditions": [{"name": "one"}, {"name": "two", "nproc": 2}],
}


def test_nproc_beyond_visible_gpus_is_refused():
    spec = parse_spec(SPEC)
    with pytest.raises(BenchNprocError, match=r"condition 'two': nproc: 2 needs 2 GPUs, but 1 is visible"):
        check_nproc(spec, gpus=1)
    check_nproc(spec, gpus=2)


def test_reference_rows_take_no_nproc():
    from hone.config.errors import ConfigError

    bad = {**SPEC, "conditions": [{"name": "ref", "reference": "hf-peft", "nproc": 2}]}
    with pytest.raises((ConfigError, ValueError), match="nproc applies to hone conditions"):
        parse_spec(bad)


def test_worker_command_uses_torchrun_for_several_processes():
    spec = parse_spec(SPEC)
    one, two = spec.conditions
    assert "torch.distributed.run" not in worker_command(Path("s.json"), one, 0, Path("r.json"))
    cmd = worker_command(Path("s.json"), two, 0, Path("r.json"))
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def test_rank_rows_merge_and_scale():
    ranks = [
        {
            "median_ms": 100.0,
            "tokens_per_s": 1000.0,
            "trained_tokens_per_s": 900.0,
            "peak_alloc_gib": 10.0,
            "peak_reserved_gib": 11.0,
            "decided": {"fp8": "tensorwise"},  # rank 0 writes the run's record
        },
        {
            "median_ms": 110.0,
            "tokens_per_s": 950.0,
            "trained_tokens_per_s": 850.0,
            "peak_alloc_gib": 12.0,
            "peak_reserved_gib": 13.0,
        },
    ]
    merged = merge_ranks(ranks)
    assert merged["median_ms"] == 110.0 and merged["tokens_per_s"] == 1950.0 and merged["tokens_per_s_per_gpu"] == 975.0
    assert merged["peak_alloc_gib"] == 12.0 and merged["peak_alloc_gib_per_rank"] == [10.0, 12.0]
    assert merged["decided"] == {"fp8": "tensorwise"}  # though rank 1 was the slowest
    rows = [
        {"status": "ok", "kind": "hone", "nproc": 1, "condition": "one", "set": {}, "tokens_per_s": 1000.0},
        {"status": "ok", "kind": "hone", "condition": "two", "set_without_nproc": {}, **merged},
    ]
    add_scaling(rows)
    assert rows[1]["scaling"] == 1.95 and rows[1]["scaling_vs"] == "one" and rows[1]["scaling_per_gpu"] == 0.975


def test_table_shows_gpus_per_gpu_throughput_and_scaling():
    from hone.bench.report import markdown_table, summarise

    spec = parse_spec(SPEC)
    base = {
        "status": "ok",
        "median_ms": 100.0,
        "min_ms": 99.0,
        "max_ms": 101.0,
        "first_step_s": 1.0,
        "tokens_per_s": 1000.0,
        "trained_tokens_per_s": 1000.0,
        "peak_alloc_gib": 10.0,
        "mfu_pct": 40.0,
        "final_loss": 5.0,
    }
    rows = [
        {**base, "condition": "one", "nproc": 1},
        {**base, "condition": "two", "nproc": 2, "tokens_per_s": 1950.0, "tokens_per_s_per_gpu": 975.0, "scaling": 1.95,
         "scaling_per_gpu": 0.975, "peak_vs_one": 0.604},
    ]  # fmt: skip
    table = markdown_table(spec, summarise(spec, rows))
    assert "| last loss | GPUs | tok/s per GPU | scaling vs 1 GPU | per GPU vs 1 GPU | peak vs 1 GPU |" in table
    two = next(line for line in table.splitlines() if line.startswith("| two"))
    assert two.endswith("| 2 | 975 | 1.95x | 0.97x | 60% |")
