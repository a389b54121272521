"""``training.objective`` and ``training.preference``: what they accept, what they refuse (each
refusal naming its key), and how ``reference: auto`` resolves."""

import pytest

from hone.cli import main
from hone.config import ConfigError, parse_config
from hone.config.loader import dump_config


def _cfg(training: dict, **sections) -> dict:
    raw = {
        "model": {"preset": "tiny-llama"},
        "data": {"datasets": [{"path": "p.jsonl", "type": "preference"}]},
        "training": training,
    }
    raw.update(sections)
    return raw


def test_a_preference_objective_and_its_settings_parse_and_dump_round_trip():
    import yaml

    cfg = parse_config(_cfg({"objective": "dpo", "preference": {"beta": 0.2, "label_smoothing": 0.1}}))
    assert cfg.training.is_preference and cfg.training.preference.beta == 0.2
    assert cfg.preference_reference == "adapter_disabled"  # auto with LoRA (the default adapter)
    assert parse_config(yaml.safe_load(dump_config(cfg))) == cfg
    sft = parse_config({"model": {"preset": "tiny-llama"}, "data": {"datasets": [{"path": "c.jsonl", "type": "chat"}]}})
    assert parse_config(yaml.safe_load(dump_config(sft))) == sft and sft.preference_reference is None


@pytest.mark.parametrize(
    "objective, adapter, asked, resolved",
    [
        ("dpo", "lora", "auto", "adapter_disabled"),
        ("ipo", "none", "auto", "precomputed"),
        ("dpo", "lora", "precomputed", "precomputed"),
        ("orpo", "none", "auto", None),
    ],
)
def test_the_reference_resolves_by_the_adapter(objective, adapter, asked, resolved):
    preference = {"reference": asked} if asked != "auto" else {}
    cfg = parse_config(_cfg({"objective": objective, "preference": preference}, adapter={"type": adapter}))
    assert cfg.preference_reference == resolved


@pytest.mark.parametrize(
    "training, sections, key, words",
    [
        ({"preference": {"beta": 0.2}}, {}, "training.preference.beta", "training.objective is sft"),
        ({"objective": "ipo", "preference": {"label_smoothing": 0.1}}, {}, "training.preference.label_smoothing", "dpo only"),
        ({"objective": "orpo", "preference": {"reference": "precomputed"}}, {}, "training.preference.reference", "no reference"),
        ({"objective": "dpo", "preference": {"beta": 0}}, {}, "beta", "greater than 0"),
        ({"objective": "dpo", "preference": {"label_smoothing": 0.5}}, {}, "label_smoothing", "less than 0.5"),
        (
            {"objective": "dpo", "preference": {"reference": "adapter_disabled"}},
            {"adapter": {"type": "none"}},
            "training.preference.reference: adapter_disabled",
            "adapter.type",
        ),
        (
            {"objective": "dpo"},
            {"data": {"datasets": [{"path": "p.jsonl", "type": "preference"}], "sample_packing": True}},
            "data.sample_packing",
            "pairs",
        ),
        (
            {"objective": "dpo"},
            {"distributed": {"context_parallel": 2, "strategy": "ddp"}},
            "distributed.context_parallel",
            "objective: dpo",
        ),
        (
            {"objective": "orpo"},
            {"model": {"preset": "tiny-llama", "dtype": "float16"}},
            "model.dtype: float16",
            "objective: orpo",
        ),
        ({"objective": "dpo"}, {"memory": {"tiled_layers": 2}}, "memory.tiled_layers", "objective: dpo"),
    ],
)
def test_what_a_preference_run_refuses_names_its_key(training, sections, key, words):
    with pytest.raises(ConfigError) as info:
        parse_config(_cfg(training, **sections))
    text = str(info.value)
    assert key in text and words in text, text


def test_validate_refuses_sft_rows_with_a_preference_objective(tmp_path, capsys):
    data = tmp_path / "c.jsonl"
    data.write_text('{"text": "hello there"}\n')
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(
        f"model: {{preset: tiny-llama}}\ndata:\n  datasets:\n    - {{path: {data}, type: completion}}\n"
        f"training: {{objective: orpo, output_dir: {tmp_path / 'out'}}}\n"
    )
    assert main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "training.objective: 'orpo' trains on preference pairs, but data.datasets.0.type is completion" in err


def test_validate_summarises_the_objective():
    from hone.config.summary import summarize

    lines = summarize(parse_config(_cfg({"objective": "ipo", "micro_batch_size": 2}, adapter={"type": "none"})))
    training = next(line for line in lines if line.strip().startswith("training"))
    assert "ipo (beta 0.1, reference: precomputed before the first step)" in training and "micro-batch 2 pairs" in training


def test_the_plan_refuses_a_model_whose_logits_are_not_the_plain_projection():
    import torch

    from hone.transforms.base import RunFacts
    from hone.transforms.planner import PlanError, plan_optimizations

    model = {"preset": "tiny-gemma", "preset_overrides": {"final_logit_softcapping": 30.0}}
    cfg = parse_config(_cfg({"objective": "orpo"}, model=model))
    with pytest.raises(PlanError, match="training.objective: orpo sums log-probabilities .* soft-caps its logits"):
        plan_optimizations(cfg, RunFacts(torch.device("cpu")))
