"""The allocator's retries: read with the step's memory peaks, warned about once after the first step."""

from types import SimpleNamespace

import torch

from hone.train import device as device_module
from hone.train.allocator_watch import RetryWatch
from hone.train.device import memory_reading


def test_retries_after_the_first_step_are_warned_once_naming_the_remedies():
    said: list[str] = []
    watch = RetryWatch(said.append)
    watch.on_step(1, 4, 39.0)  # the first step: cache growth and autotuning may retry
    watch.on_step(2, 4, 39.0)
    assert said == []
    watch.on_step(3, 7, 41.9)
    watch.on_step(4, 12, 41.9)
    assert len(said) == 1
    assert said[0].startswith("step 3: the CUDA caching allocator found the card full 3 time(s) since the first step")
    assert "peak reserved 41.9 GiB" in said[0] and "memory.expandable_segments: true" in said[0]


def test_a_cpu_run_has_nothing_to_watch():
    said: list[str] = []
    watch = RetryWatch(said.append)
    for step in (1, 2, 3):
        watch.on_step(step, None, None)
    assert said == []
    reading = memory_reading(torch.device("cpu"))
    assert reading.peak_reserved_gib is None and reading.alloc_retries is None and reading.peak_allocated_gib > 0


def test_the_cuda_reading_takes_the_retries_from_the_same_stats(monkeypatch):
    stats = {
        "allocated_bytes": {"all": {"peak": 3 * 2**30}},
        "reserved_bytes": {"all": {"peak": 4 * 2**30}},
        "num_alloc_retries": 5,
    }
    monkeypatch.setattr(device_module.torch.cuda, "memory_stats_as_nested_dict", lambda device: stats)
    assert memory_reading(SimpleNamespace(type="cuda")) == (3.0, 4.0, 5)


def test_the_bench_table_notes_a_row_that_retried_at_the_card_s_limit():
    from hone.bench.report import markdown_table, summarise
    from hone.bench.spec import parse_spec

    spec = parse_spec(
        {"name": "t", "workload": {"preset": "tiny-llama"}, "conditions": [{"name": "roomy"}, {"name": "full card"}]},
        "test",
    )
    rows = [
        {"condition": name, "replicate": 0, "status": "ok", "median_ms": ms, "min_ms": ms, "max_ms": ms,
         "first_step_s": 1.0, "tokens_per_s": 1.0, "trained_tokens_per_s": 1.0, "mfu_pct": 1.0, "final_loss": 1.0,
         "peak_alloc_gib": 39.0, "peak_reserved_gib": 41.9, "alloc_retries": retries}
        for name, ms, retries in (("roomy", 400.0, 0), ("full card", 790.0, 57))
    ]  # fmt: skip
    table = markdown_table(spec, summarise(spec, rows))
    assert "- full card: the CUDA caching allocator retried 57 allocation(s) at the card's limit" in table
    assert "- roomy:" not in table
