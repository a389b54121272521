"""Model ids resolved through a Hugging Face hub cache laid out in a temp dir (no network)."""

import json
import random
import shutil
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from hone.cli import main
from hone.config import parse_config
from hone.models.hub import HubId, HubModelNotFound, hub_id_of, local_model_dir, parse_hub_id
from hone.models.tokenizer import load_tokenizer
from hone.testing import save_tiny_model, tiny_tokenizer

MAIN = "a" * 40
OLD = "b" * 40


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """Two tiny models with different weights (seeds), saved once for the module."""
    root = tmp_path_factory.mktemp("saved")
    tok = tiny_tokenizer()
    return save_tiny_model(root / "new", "tiny-llama", tok, seed=1), save_tiny_model(root / "old", "tiny-llama", tok, seed=2)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, saved_models):
    """``models--Org--Tiny`` with ``main`` -> snapshot MAIN and tag ``v1`` -> snapshot OLD."""
    cache = tmp_path / "hub"
    repo = cache / "models--Org--Tiny"
    new, old = saved_models
    shutil.copytree(new, repo / "snapshots" / MAIN)
    shutil.copytree(old, repo / "snapshots" / OLD)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(OLD)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: a lookup that tried the network would fail
    monkeypatch.chdir(tmp_path)  # relative paths: no 'Org/Tiny' directory exists here
    return cache


def test_parse_hub_id_shapes():
    assert parse_hub_id("Qwen/Qwen3-8B") == HubId("Qwen/Qwen3-8B")
    assert parse_hub_id("Qwen/Qwen3-8B@refs/pr/1") == HubId("Qwen/Qwen3-8B", "refs/pr/1")
    assert str(HubId("a/b", "v1")) == "a/b@v1"
    for local in ("/abs/dir", "a/b/c", "../x/y", "~/m", "single"):
        assert parse_hub_id(local) is None


def test_existing_local_directory_wins(tmp_path, monkeypatch):
    (tmp_path / "Org" / "Tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub_id_of(Path("Org/Tiny")) is None
    assert local_model_dir(Path("Org/Tiny")) == Path("Org/Tiny")


def test_resolves_by_id_by_ref_and_by_commit(hub_cache):
    snapshots = hub_cache / "models--Org--Tiny" / "snapshots"
    assert local_model_dir(Path("Org/Tiny")).resolve() == (snapshots / MAIN).resolve()
    assert local_model_dir(Path("Org/Tiny@v1")).resolve() == (snapshots / OLD).resolve()
    assert local_model_dir(Path(f"Org/Tiny@{OLD}")).resolve() == (snapshots / OLD).resolve()


def test_hf_home_is_honoured(hub_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    home = hub_cache.parent / "home"
    home.mkdir()
    hub_cache.rename(home / "hub")
    monkeypatch.setenv("HF_HOME", str(home))
    assert local_model_dir(Path("Org/Tiny")).name == MAIN


@pytest.mark.parametrize("value", ["Org/Missing", "Org/Tiny@v9"])
def test_missing_id_says_which_where_and_how(hub_cache, value):
    with pytest.raises(HubModelNotFound) as info:
        local_model_dir(Path(value))
    text = str(info.value)
    assert text.startswith("model.path:") and f"'{value}'" in text
    assert str(hub_cache) in text and "huggingface-cli download" in text and "allow_download" in text
    if "@" in value:
        assert "--revision v9" in text


def _rows() -> str:
    rng = random.Random()
    words = ["plum", "purple", "sky", "blue", "grass", "green"]
    return "".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(8))}) + "\n" for _ in range(12))


def _cfg_file(tmp_path, model: dict, steps: int = 2, data: str | None = None) -> Path:
    if data is None:
        data = str(tmp_path / "data.jsonl")
        Path(data).write_text(_rows())
    raw = {
        "model": {"dtype": "float32", **model},
        "data": {
            "datasets": [{"path": data, "type": "completion"}],
            "sequence_len": 32,
            "dataset_prepared_path": str(tmp_path / "prep"),
        },
        "adapter": {"type": "lora", "lora_r": 2},
        "training": {"max_steps": steps, "micro_batch_size": 2, "output_dir": str(tmp_path / "run")},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
    }
    path = tmp_path / "cfg.yml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_validate_accepts_a_cached_id_and_rejects_a_missing_one(hub_cache, tmp_path, capsys):
    assert main(["validate", str(_cfg_file(tmp_path, {"path": "Org/Tiny@v1"}))]) == 0
    capsys.readouterr()
    assert main(["validate", str(_cfg_file(tmp_path, {"path": "Org/Missing"}))]) == 2
    err = capsys.readouterr()
    text = err.out + err.err
    assert "model.path" in text and "Org/Missing" in text and "huggingface-cli download" in text


def test_validate_with_allow_download_warns_instead(hub_cache, tmp_path, capsys):
    cfg = _cfg_file(tmp_path, {"path": "Org/Missing", "allow_download": True})
    assert main(["validate", str(cfg)]) == 0
    err = capsys.readouterr()
    assert "will download" in err.out + err.err


def test_tokenizer_path_as_id(hub_cache, saved_models):
    tok = load_tokenizer(
        parse_config(
            {
                "model": {"path": str(saved_models[0]), "tokenizer_path": "Org/Tiny"},
                "data": {"datasets": [{"path": "d.jsonl", "type": "completion"}]},
            }
        ).model
    )
    assert len(tok) == len(tiny_tokenizer())


@pytest.fixture
def hub_dataset(hub_cache):
    """``datasets--Org--Data`` with ``train.jsonl`` in snapshot MAIN (ref main)."""
    repo = hub_cache / "datasets--Org--Data"
    (repo / "snapshots" / MAIN).mkdir(parents=True)
    (repo / "snapshots" / MAIN / "train.jsonl").write_text(_rows())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    return repo / "snapshots" / MAIN / "train.jsonl"


def test_dataset_file_from_the_cache(hub_dataset, tmp_path, capsys):
    from hone.data.errors import DataError
    from hone.data.hub_files import local_data_file, parse_hub_file

    assert parse_hub_file("hf://datasets/Org/Data@v2/sub/x.jsonl").revision == "v2"
    assert parse_hub_file(Path("hf://datasets/Org/Data/x.jsonl")).filename == "x.jsonl"  # pathlib folds '//'
    assert local_data_file(Path("hf://datasets/Org/Data/train.jsonl"), "k") == hub_dataset
    with pytest.raises(DataError, match="--repo-type dataset"):
        local_data_file(Path("hf://datasets/Org/Data/test.jsonl"), "k")
    assert main(["validate", str(_cfg_file(tmp_path, {"path": "Org/Tiny"}, data="hf://datasets/Org/Data/train.jsonl"))]) == 0
    capsys.readouterr()
    assert main(["validate", str(_cfg_file(tmp_path, {"path": "Org/Tiny"}, data="hf://datasets/Org/Nope/train.jsonl"))]) == 2
    err = capsys.readouterr()
    assert "data.datasets[0].path" in err.err and "Org/Nope" in err.err


def test_a_tiny_training_run_loads_the_model_by_id(hub_dataset, hub_cache, tmp_path, saved_models):
    from safetensors.torch import load_file

    from hone.config.loader import load_config
    from hone.train.run import run_training

    cfg = load_config(_cfg_file(tmp_path, {"path": "Org/Tiny@v1"}, data="hf://datasets/Org/Data/train.jsonl"))
    result = run_training(cfg, device="cpu", console=Console(quiet=True))
    assert result.steps == 2 and result.final_train_loss is not None
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").exists()
    # the run trained the v1 snapshot (seed 2), not main: the merged-free base weights tell them apart
    from hone.models.loader import build_base_model

    base = build_base_model(cfg.model, load_tokenizer(cfg.model), "cpu", __import__("torch").float32, seed=0)
    saved = load_file(str(saved_models[1] / "model.safetensors"))
    name = next(n for n in saved if n.endswith("q_proj.weight"))
    assert base.state_dict()[name].equal(saved[name])


def test_download_missing_downloads_nothing_it_need_not(hub_cache):
    """Without allow_download nothing is fetched; with it, a cached id is not fetched again
    (the fixture's HF_HUB_OFFLINE and the missing network would make a fetch fail)."""
    from hone.models.hub import download_missing

    said = []
    base = {"data": {"datasets": [{"path": "d.jsonl", "type": "completion"}]}}
    missing = parse_config({**base, "model": {"path": "Org/Missing"}}).model
    assert download_missing(missing, say=said.append) == []
    cached = parse_config({**base, "model": {"path": "Org/Tiny", "tokenizer_path": "Org/Tiny@v1", "allow_download": True}}).model
    assert download_missing(cached, say=said.append) == [] and said == []


def test_allow_download_needs_an_id_or_path():
    from hone.config.errors import ConfigError

    with pytest.raises(ConfigError, match="allow_download"):
        parse_config(
            {
                "model": {"preset": "tiny-llama", "allow_download": True},
                "data": {"datasets": [{"path": "d.jsonl", "type": "completion"}]},
            }
        )
