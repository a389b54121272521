"""The typed config: parsing, every error reported at once with paths and suggestions."""

import json
from pathlib import Path

import pytest

from hone.config import ConfigError, HoneConfig, apply_overrides, load_config, parse_config
from hone.config.loader import dump_config

MINIMAL = {
    "model": {"preset": "tiny-llama"},
    "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca"}]},
}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yml"
    path.write_text(text)
    return path


def issues_of(exc: ConfigError) -> dict[str, str]:
    return {issue.path: issue.message for issue in exc.issues}


def test_minimal_config_fills_defaults():
    cfg = parse_config(MINIMAL)
    assert isinstance(cfg, HoneConfig)
    assert cfg.adapter.type == "lora" and cfg.adapter.lora_r == 16
    assert cfg.data.sequence_len == 2048
    assert cfg.training.epochs == 1.0
    assert cfg.data.datasets[0].resolved_format == "jsonl"


def test_three_mistakes_reported_together_with_lines_and_suggestions(tmp_path):
    path = write(
        tmp_path,
        """\
model:
  preset: tiny-llama
data:
  datasets:
    - path: d.jsonl
      type: chatml
training:
  micro_batch_size: two
  lerning_rate: 1e-4
""",
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    found = issues_of(info.value)
    assert len(info.value.issues) == 3
    assert "did you mean 'chat'" in found["data.datasets[0].type"]
    assert "alpaca, chat, completion, pretokenized" in found["data.datasets[0].type"]
    assert "integer" in found["training.micro_batch_size"] and "'two'" in found["training.micro_batch_size"]
    assert "did you mean 'optimizer.learning_rate'" in found["training.lerning_rate"]
    lines = {i.path: i.line for i in info.value.issues}
    assert lines == {"data.datasets[0].type": 6, "training.micro_batch_size": 8, "training.lerning_rate": 9}
    rendered = info.value.render()
    assert "3 problems" in rendered and f"{path}:6:" in rendered


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("lora_rr", "adapter.lora_r"),
        ("r", "adapter.lora_r"),
        ("target_modules", "adapter.lora_target_modules"),
    ],
)
def test_unknown_adapter_key_suggestions(key, expected):
    with pytest.raises(ConfigError) as info:
        parse_config({**MINIMAL, "adapter": {key: 8}})
    assert f"did you mean '{expected}'" in issues_of(info.value)[f"adapter.{key}"]


def test_axolotl_style_flat_key_points_to_its_section():
    with pytest.raises(ConfigError) as info:
        parse_config({**MINIMAL, "sequence_len": 4096, "micro_batch_size": 2})
    found = issues_of(info.value)
    assert "data.sequence_len" in found["sequence_len"]
    assert "training.micro_batch_size" in found["micro_batch_size"]


def test_bad_enum_lists_allowed_values():
    with pytest.raises(ConfigError) as info:
        parse_config({**MINIMAL, "model": {"preset": "tiny-llama", "dtype": "bf16"}})
    message = issues_of(info.value)["model.dtype"]
    assert "'bf16' is not one of: float32, bfloat16, float16" in message


def test_format_specific_key_on_wrong_format_is_an_error():
    raw = {**MINIMAL, "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca", "field_messages": "m"}]}}
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    message = issues_of(info.value)["data.datasets[0].field_messages"]
    assert "unknown key for type 'alpaca'" in message and "belongs to type 'chat'" in message
    assert "did you mean" not in message  # not the same key handed back as a typo fix


@pytest.mark.parametrize(
    ("patch", "path", "fragment"),
    [
        ({"model": {}}, "model", "exactly one of model.path"),
        ({"model": {"preset": "tiny-llama", "path": "/x"}}, "model", "exactly one of"),
        ({"training": {"max_steps": 5, "num_epochs": 2}}, "training", "not both"),
        ({"optimizer": {"warmup_steps": 5, "warmup_ratio": 0.1}}, "optimizer", "not both"),
        ({"adapter": {"type": "none", "lora_r": 8}}, "adapter", "lora_r only apply"),
        ({"adapter": {"lora_alpha": 0}}, "adapter.lora_alpha", "greater than 0"),
        ({"training": {"eval_steps": 10}}, "", "no eval data"),
        ({"data": {"datasets": []}}, "data.datasets", "at least 1"),
        ({"data": {"datasets": [{"path": "d.txt", "type": "completion"}]}}, "data.datasets[0]", "file_format"),
    ],
)
def test_rules(patch, path, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config({**MINIMAL, **patch})
    found = issues_of(info.value)
    assert path in found, found
    assert fragment in found[path]


def test_adapter_shorthand():
    assert parse_config({**MINIMAL, "adapter": "none"}).adapter.type == "none"
    assert parse_config({**MINIMAL, "adapter": "lora"}).adapter.is_lora


def test_validation_does_not_rewrite_user_values():
    raw = {**MINIMAL, "optimizer": {"learning_rate": "2e-4", "warmup_steps": 1000}, "training": {"max_steps": 10}}
    cfg = parse_config(raw)
    assert cfg.optimizer.warmup_steps == 1000  # kept as written; the clamp is a derived value
    assert cfg.optimizer.warmup_for(10) == 10
    assert cfg.optimizer.learning_rate == pytest.approx(2e-4)


def test_config_is_frozen():
    cfg = parse_config(MINIMAL)
    with pytest.raises(Exception):  # noqa: B017 -- pydantic's frozen-instance error class is its own business
        cfg.training.seed = 1  # type: ignore[misc]


def test_overrides_apply_and_report_unknown_keys(tmp_path):
    path = write(tmp_path, "model: {preset: tiny-llama}\ndata: {datasets: [{path: d.jsonl, type: alpaca}]}\n")
    cfg = load_config(path, ["optimizer.learning_rate=1e-4", "data.datasets.0.type=completion", "adapter=none"])
    assert cfg.optimizer.learning_rate == pytest.approx(1e-4)
    assert cfg.data.datasets[0].type == "completion"
    assert cfg.adapter.type == "none"
    with pytest.raises(ConfigError) as info:
        load_config(path, ["training.lr=2e-4"])
    issue = info.value.issues[0]
    assert issue.path == "training.lr" and issue.from_override and "optimizer.learning_rate" in issue.message
    assert "--set training.lr" in info.value.render()


@pytest.mark.parametrize("bad", ["nokey", "=3", "data.datasets.5.path=x.jsonl"])
def test_malformed_overrides(bad):
    with pytest.raises(ConfigError):
        apply_overrides(MINIMAL, [bad])


def test_overrides_leave_input_untouched():
    raw = {"model": {"preset": "tiny-llama"}}
    apply_overrides(raw, ["model.dtype=float32"])
    assert raw == {"model": {"preset": "tiny-llama"}}


def test_malformed_yaml_gives_line(tmp_path):
    path = write(tmp_path, "model:\n  preset: tiny-llama\ndata: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.issues[0].line is not None and "malformed YAML" in info.value.issues[0].message


def test_duplicate_keys_are_errors(tmp_path):
    path = write(
        tmp_path, "model:\n  preset: tiny-llama\n  preset: tiny-qwen3\ndata: {datasets: [{path: d.jsonl, type: alpaca}]}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "duplicate key (first set on line 2)" in issues_of(info.value)["model.preset"]


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yml")


def test_dump_round_trips():
    cfg = parse_config({**MINIMAL, "adapter": {"lora_target_modules": "all-linear"}})
    import yaml

    again = parse_config(yaml.safe_load(dump_config(cfg)))
    assert again == cfg


def test_json_schema_is_serialisable():
    schema = HoneConfig.model_json_schema()
    text = json.dumps(schema)
    assert "sequence_len" in text and "lora_target_modules" in text


def test_config_reference_is_up_to_date():
    from hone.config.docs import DOC_PATH, render

    assert DOC_PATH.read_text() == render(), "docs/config.md is stale: run python -m hone.config.docs"


def test_full_finetune_config_dumps_and_reloads():
    import yaml

    cfg = parse_config({**MINIMAL, "adapter": "none"})
    dumped = yaml.safe_load(dump_config(cfg))
    assert dumped["adapter"] == {"type": "none"}
    assert parse_config(dumped) == cfg
