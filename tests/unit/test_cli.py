"""The command line: exit codes and what it prints, without loading any model."""

import json

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
    assert main(["validate", str(cfg), "--set", "training.max_steps=7"]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "max_steps: 7" in out and "lora_r: 16" in out


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
