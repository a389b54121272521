"""``hone bench`` with ``workload.data: pairs`` (issue 28's DPO benchmark): the spec's checks,
the synthetic pairs (text of one-token words) that hone's own preference pipeline reads back at
exactly the lengths asked for, the row's config, the FLOP model's reference forward and the
table's pairs/s column. Training the rows needs the preference objective (training.objective)."""

import re
from pathlib import Path

import pytest

from hone.bench.flops import flops_per_token
from hone.bench.pairs import single_token_words, write_pairs
from hone.bench.report import markdown_table
from hone.bench.spec import load_spec, parse_spec
from hone.config import ConfigError
from hone.data.prepare import prepare_data

SPEC = Path(__file__).resolve().parents[2] / "benchmarks" / "specs" / "qwen3-8b-dpo.yml"


def pairs_spec(conditions=None, **workload):
    raw = {
        "name": "tiny-pairs",
        "workload": {"preset": "tiny-llama", "sequence_len": 48, "dtype": "float32", "data": "pairs",
                     "prompt_len": 20, "completion_len": 12, **workload},
        "conditions": conditions or [{"name": "hone"}],
        "warmup_steps": 1,
        "timed_steps": 2,
    }  # fmt: skip
    return parse_spec(raw)


def test_the_dpo_spec_is_the_issue_workload():
    spec = load_spec(SPEC)
    w = spec.workload
    assert (w.preset, w.data, w.objective, w.micro_batch_size) == ("qwen3-8b", "pairs", "dpo", 1)
    assert w.prompt_len + 2 * w.completion_len == 2048 and w.pairs_per_step == 1
    assert w.tokens_per_step == 2 * (512 + 768)  # both sequences of the pair
    assert {c.reference for c in spec.conditions} == {None, "trl-dpo"}  # TRL in the same call
    compiled = load_spec(SPEC.with_name("qwen3-8b-dpo-compiled.yml"))
    assert compiled.workload == w and {c.compile for c in compiled.conditions if c.reference} == {True}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"conditions": [{"name": "ref", "reference": "hf-peft"}]}, "or use reference: trl-dpo"),
        ({"completion_len": 40}, "prompt_len 20 + completion_len 40 is beyond sequence_len 48"),
        ({"objective": "orpo", "conditions": [{"name": "t", "reference": "trl-dpo"}]}, "objective: dpo or ipo"),
        ({"adapter": {"type": "none"}, "conditions": [{"name": "t", "reference": "trl-dpo"}]}, "trains a LoRA"),
        ({"conditions": [{"name": "r", "reference": "hf-peft", "precompute_ref": True}]}, "reference: trl-dpo only"),
    ],
)
def test_pairs_refuse_the_sft_reference_and_pairs_that_do_not_fit(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        pairs_spec(**change)


def test_generated_pairs_have_the_asked_lengths_in_hones_own_pipeline(tmp_path, tokenizer, make_data_config):
    w = pairs_spec().workload
    assert len(single_token_words(tokenizer)) >= 16
    path = tmp_path / "pairs.jsonl"
    write_pairs(path, w, tokenizer, count=5, seed=3)
    prepared = prepare_data(make_data_config([{"path": path, "type": "preference"}], sequence_len=48), tokenizer)
    rows = prepared.train.to_list()
    assert len(rows) == 5
    for row in rows:
        assert len(row["prompt_ids"]) == 20 and row["prompt_ids"][0] == tokenizer.bos_token_id
        assert len(row["chosen_ids"]) == len(row["rejected_ids"]) == 12
        assert row["chosen_ids"][-1] == row["rejected_ids"][-1] == tokenizer.eos_token_id
        assert row["chosen_ids"] != row["rejected_ids"]
    again = tmp_path / "again.jsonl"
    write_pairs(again, w, tokenizer, count=5, seed=3)
    assert again.read_text() == path.read_text()  # seeded: every condition trains the same pairs


def test_a_pairs_row_trains_the_preference_objective_on_a_preference_dataset(tmp_path):
    from hone.bench.worker import _hone_config

    spec = pairs_spec(objective="ipo")
    cfg = _hone_config(spec, spec.conditions[0], tmp_path, tmp_path / "pairs.jsonl")
    assert cfg.data.datasets[0].type == "preference" and cfg.training.objective == "ipo"


def test_trl_rows_need_pairs():
    raw = {"workload": {"preset": "tiny-llama"}, "conditions": [{"name": "t", "reference": "trl-dpo"}]}
    with pytest.raises(ConfigError, match="set workload.data: pairs"):
        parse_spec(raw)


def test_a_trl_row_runs_the_peer_with_the_workload_and_the_condition():
    import torch

    from hone.bench.trl_reference import load_peer, peer_args

    spec = pairs_spec(
        conditions=[{"name": "t", "reference": "trl-dpo", "gradient_checkpointing": True, "precompute_ref": True}],
        objective="ipo",
        gradient_accumulation_steps=2,
    )
    a = peer_args(load_peer(), spec, spec.conditions[0], torch.device("cpu"))
    assert (a.prompt_len, a.completion_len, a.mbs, a.accum, a.warmup, a.steps) == (20, 12, 1, 2, 1, 2)
    assert (a.gc, a.compile, a.precompute_ref, a.loss, a.cpu, a.dtype) == (1, 0, 1, "ipo", 1, "float32")
    assert (a.rank, a.alpha, a.targets) == (16, 32.0, "q_proj,k_proj,v_proj,o_proj")


def test_the_flop_model_adds_the_reference_forward():
    from types import SimpleNamespace

    config = SimpleNamespace(hidden_size=8, vocab_size=10, num_attention_heads=2, head_dim=4, num_hidden_layers=3)
    n_active = 1000 - 10 * 8
    extra = flops_per_token(config, 1000, 64, False, reference_forward=True) - flops_per_token(config, 1000, 64, False)
    assert extra == 2 * n_active + 2 * 3 * 64 * 8


def test_the_table_shows_pairs_per_second():
    spec = pairs_spec()
    row = {"condition": "hone", "kind": "hone", "runs": 1, "ok": 1, "median_ms": 500.0, "min_ms": 490.0, "max_ms": 510.0,
           "pairs_per_s": 2.0, "tokens_per_s": 128.0, "peak_alloc_gib": 1.0, "mfu_pct": 1.0, "first_step_s": 1.0,
           "final_loss": 0.69}  # fmt: skip
    text = markdown_table(spec, [row])
    assert "| pairs/s | tok/s |" in text and "| hone | 500.0 (490.0-510.0) |  | 2.00 | 128 |" in text
    assert "DPO on pairs of a 20-token prompt and two 12-token completions (44 tokens a pair)" in text


def test_a_one_process_row_sees_the_first_visible_gpu_only():
    from hone.bench.harness import one_gpu

    assert one_gpu(None) == "0"
    assert one_gpu("2,3") == "2"
    assert one_gpu("1") == "1"
    assert one_gpu("") == ""  # no GPU stays no GPU
