"""Config mistakes a new user makes (issue 30, item 10): each reported as the mistake it is."""

from rich.console import Console

from hone.cli import main

AXOLOTL = """\
base_model: Qwen/Qwen2.5-0.5B
model_type: AutoModelForCausalLM
load_in_8bit: false
datasets:
  - path: tatsu-lab/alpaca
    type: alpaca
val_set_size: 0.05
output_dir: ./outputs/out
sequence_len: 2048
adapter: lora
lora_r: 32
lora_alpha: 16
lora_target_linear: true
gradient_accumulation_steps: 4
micro_batch_size: 2
num_epochs: 1
optimizer: adamw_bnb_8bit
learning_rate: 0.0002
bf16: auto
"""


def _good(tmp_path, dataset: str = "type: alpaca"):
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(f"model:\n  preset: tiny-llama\ndata:\n  datasets:\n    - path: {data}\n      {dataset}\n")
    return cfg


def test_a_misspelt_type_is_the_error_not_a_missing_type(tmp_path, capsys):
    cfg = _good(tmp_path, "tpye: alpaca")
    assert main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}:6: data.datasets[0].tpye: unknown key (did you mean 'type'?" in err
    assert "alpaca, chat" in err and "missing" not in err


def test_errors_from_set_name_the_set_argument_not_line_1(tmp_path, capsys):
    cfg = _good(tmp_path)
    code = main(["validate", str(cfg), "--set", "traning.max_steps=5", "--set", "data.datasets.0.tpye=chat"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--set traning: unknown key (did you mean 'training'?)" in err
    assert "--set data.datasets[0].tpye: unknown key" in err
    assert f"{cfg}:1:" not in err


def test_a_file_check_on_an_overridden_key_names_the_set_argument(tmp_path, capsys):
    cfg = _good(tmp_path)
    assert main(["validate", str(cfg), "--set", "data.datasets.0.path=nope.jsonl"]) == 2
    assert "--set data.datasets[0].path: data file not found: 'nope.jsonl'" in capsys.readouterr().err


def test_an_override_that_is_not_yaml_is_an_error_not_a_traceback(tmp_path, capsys):
    assert main(["validate", str(_good(tmp_path)), "--set", "data.sequence_len=["]) == 2
    assert "data.sequence_len: the value '[' is not valid YAML" in capsys.readouterr().err


def test_an_axolotl_config_is_pointed_at_hone_convert(tmp_path, capsys):
    cfg = tmp_path / "axo.yml"
    cfg.write_text(AXOLOTL)
    assert main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "this looks like an Axolotl config" in err
    assert f"hone convert {cfg} -o {tmp_path / 'axo.hone.yml'}" in err
    listed = [line for line in err.splitlines() if line.startswith("  - ")]
    assert 1 <= len(listed) <= 3 and all("did you mean" in line for line in listed)
    assert len(err.splitlines()) <= 8


def test_a_hone_config_with_one_flat_key_gets_no_axolotl_paragraph(tmp_path, capsys):
    cfg = _good(tmp_path)
    cfg.write_text(cfg.read_text() + "micro_batch_size: 2\n")
    assert main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "Axolotl" not in err and "did you mean 'training.micro_batch_size'" in err


def test_training_warnings_go_to_stderr(capsys):
    from hone.train.run import _Warn

    _Warn(Console())("the run directory holds an older run")
    captured = capsys.readouterr()
    assert captured.out == "" and "warning: the run directory holds an older run" in captured.err
