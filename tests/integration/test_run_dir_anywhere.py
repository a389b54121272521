"""A run directory works from any working directory (issue 30, item 3): a LoRA run on a relative
``model.path`` records absolute paths in its ``config.yml`` and in ``final/adapter_config.json``, so
``hone generate`` / ``hone merge`` and ``PeftModel.from_pretrained`` load it from elsewhere."""

import json

import pytest
import torch
import yaml

from hone.cli import main
from hone.config.loader import load_config
from hone.config.recorded import recorded_config
from hone.testing import save_tiny_model, tiny_config, tiny_tokenizer


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A LoRA run trained by ``hone train`` inside ``proj/`` on relative paths only."""
    proj = tmp_path_factory.mktemp("proj")
    tokenizer = tiny_tokenizer()
    save_tiny_model(proj / "models" / "tiny", "tiny-llama", tokenizer, seed=3)
    rows = [{"text": f"row {i}: a green lime and a yellow lemon"} for i in range(8)]
    (proj / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "model": {"path": "./models/tiny", "dtype": "float32"},
        "data": {
            "datasets": [{"path": "data.jsonl", "type": "completion"}],
            "sequence_len": 32,
            "dataset_prepared_path": "cache",
        },
        "adapter": {"type": "lora", "lora_r": 4},
        "training": {"output_dir": "runs/r", "max_steps": 2, "micro_batch_size": 2, "seed": 1},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
    }
    (proj / "cfg.yml").write_text(yaml.safe_dump(cfg))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(proj)
        assert main(["train", "cfg.yml"]) == 0
    return proj


def test_the_recorded_config_and_adapter_name_absolute_paths(project):
    run = project / "runs" / "r"
    recorded = yaml.safe_load((run / "config.yml").read_text())
    assert recorded["model"]["path"] == str(project / "models" / "tiny")
    assert recorded["data"]["datasets"][0]["path"] == str(project / "data.jsonl")
    assert recorded["data"]["dataset_prepared_path"] == str(project / "cache")
    assert recorded["training"]["output_dir"] == str(run)
    adapter = json.loads((run / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(project / "models" / "tiny")


def test_generate_and_merge_from_another_directory(project, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = project / "runs" / "r"
    assert main(["generate", str(run), "--prompt", "a green", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert ">>> a green" in capsys.readouterr().out
    assert main(["merge", str(run), "-o", "merged"]) == 0
    assert (tmp_path / "merged" / "config.json").is_file()


def test_peft_loads_the_adapter_from_another_directory(project, tmp_path, monkeypatch):
    from peft import AutoPeftModelForCausalLM

    from hone.export.load import load_for_inference

    monkeypatch.chdir(tmp_path)
    run = project / "runs" / "r"
    # the base comes from adapter_config.json's base_model_name_or_path alone
    model = AutoPeftModelForCausalLM.from_pretrained(str(run / "final"), local_files_only=True).eval()
    ours, _ = load_for_inference(run, "cpu")
    ids = torch.randint(0, 300, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ours(input_ids=ids).logits)


def test_recorded_config_keeps_hub_ids_and_missing_paths(tmp_path):
    (tmp_path / "here.jsonl").write_text("")
    cfg = tiny_config(
        "out",
        model={"preset": None, "path": "Org/Name"},
        data={
            "datasets": [
                {"path": "here.jsonl", "type": "pretokenized"},
                {"path": "hf://datasets/Org/Set/train.jsonl", "type": "pretokenized"},
            ]
        },
        training={"resume": "latest"},
    )
    got = recorded_config(cfg, cwd=tmp_path)
    assert str(got.model.path) == "Org/Name"  # no local directory of that name: a hub id
    assert got.data.datasets[0].path == tmp_path / "here.jsonl"
    assert got.data.datasets[1].path == cfg.data.datasets[1].path
    assert got.training.output_dir == tmp_path / "out" and got.training.resume == "latest"
    assert cfg.training.output_dir.as_posix() == "out"  # the run's own config is untouched
    # what is written reads back as a valid config
    (tmp_path / "c.yml").write_text(yaml.safe_dump(got.model_dump(mode="json")))
    assert load_config(tmp_path / "c.yml").training.output_dir == tmp_path / "out"


def test_a_run_on_a_hub_id_records_the_id(tmp_path, monkeypatch):
    """A model from the hub cache is named by its id (and revision), not by the snapshot path."""
    import io

    from rich.console import Console

    from hone.train.run import run_training

    snapshot = tmp_path / "hub" / "models--Org--Tiny" / "snapshots" / ("a" * 40)
    save_tiny_model(snapshot, "tiny-llama", tiny_tokenizer(), seed=2)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "v1").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"a green lime {i}"}) + "\n" for i in range(8)))
    cfg = tiny_config(
        "run",
        model={"preset": None, "path": "Org/Tiny@v1"},
        data={"datasets": [{"path": "d.jsonl", "type": "completion"}], "sequence_len": 16, "dataset_prepared_path": "cache"},
        adapter={"type": "lora", "lora_r": 2},
        training={"max_steps": 1},
    )
    run_training(cfg, device="cpu", console=Console(file=io.StringIO()))
    adapter = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == ("Org/Tiny", "v1")
    recorded = yaml.safe_load((tmp_path / "run" / "config.yml").read_text())
    assert recorded["model"]["path"] == "Org/Tiny@v1"
    assert recorded["data"]["datasets"][0]["path"] == str(tmp_path / "d.jsonl")
