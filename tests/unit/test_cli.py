"""The command line: exit codes and what it prints, without loading any model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hone.cli import build_parser, main


def test_validate_reports_all_mistakes_and_exits_2(tmp_path, capsys):
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(
        "model:\n  preset: tiny-llama\n  colour: red\n"
        "data:\n  sequence_len: big\n  datasets:\n    - {path: d.jsonl, type: alpca}\n"
    )
    assert main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "3 problems" in err
    assert "model.colour: unknown key" in err
    assert "data.sequence_len: expected an integer, got 'big'" in err
    assert "'alpca' is not one of" in err and "did you mean 'alpaca'" in err


def test_validate_prints_resolved_config(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(f"model: {{preset: tiny-llama}}\ndata: {{datasets: [{{path: {data}, type: alpaca}}]}}\n")
    assert main(["validate", str(cfg), "--set", "training.max_steps=7", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "max_steps: 7" in out and "lora_r: 16" in out
    assert main(["validate", str(cfg), "--set", "training.max_steps=7"]) == 0  # the summary
    out = capsys.readouterr().out
    assert out.startswith(f"{cfg}: valid\n") and "7 steps" in out and "LoRA r=16" in out and "lora_r" not in out


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("example", ["quickstart.yml", "chat_lora.yml", "moe_expert_lora.yml"])
def test_validate_on_an_example_is_at_most_15_lines(example, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the examples name their data relative to the repository
    assert main(["validate", f"examples/{example}"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == f"examples/{example}: valid" and 3 <= len(lines) <= 15, captured.out
    assert max(len(line) for line in lines) <= 130
    assert captured.err == ""


def test_validate_imports_neither_torch_nor_transformers():
    """What made validate take seconds: a preset's config class imports torch, and the
    libraries were imported only to quieten them. A preset with overrides is checked without."""
    code = (
        "import sys; from hone.cli import main; "
        "assert main(['validate', 'examples/quickstart.yml']) == 0; "
        "heavy = sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules); "
        "assert not heavy, heavy"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ("{num_hiden_layers: 3}", "'num_hiden_layers' is not a field of LlamaConfig"),
        ("{num_hidden_layers: eight}", "num_hidden_layers: expected int"),
        ("{num_key_value_heads: 3}", "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ],
)
def test_validate_checks_preset_overrides_without_building_the_config(tmp_path, capsys, overrides, fragment):
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(
        f"model: {{preset: tiny-llama, preset_overrides: {overrides}}}\ndata: {{datasets: [{{path: {data}, type: alpaca}}]}}\n"
    )
    assert main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "model.preset_overrides" in err and fragment in err, err


def test_validate_checks_files_exist(tmp_path, capsys):
    cfg = tmp_path / "cfg.yml"
    cfg.write_text("model: {path: /no/such/model}\ndata: {datasets: [{path: /no/such.jsonl, type: alpaca}]}\n")
    assert main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "model.path: model directory not found" in err
    assert "data.datasets[0].path: data file not found" in err


def test_schema_prints_json(capsys, tmp_path):
    assert main(["schema"]) == 0
    assert "HoneConfig" in json.loads(capsys.readouterr().out)["title"]
    out = tmp_path / "schema.json"
    assert main(["schema", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["title"] == "HoneConfig"


@pytest.mark.parametrize(
    "command", ["validate", "schema", "preprocess", "train", "generate", "chat", "merge", "bench", "convert"]
)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "--help"])
    assert info.value.code == 0
    assert len(capsys.readouterr().out) > 200
