"""Every config in examples/ passes ``hone validate``, as a user runs it from the repository root.

Examples that start from a real model id (``Qwen/Qwen3-8B``, ...) validate against a stand-in
hub cache (tests/conftest.py: the real config.json, a tokenizer, a tiny weights file), which is
all ``hone validate`` reads of a model; the ``# preset:`` line each of them carries, for trying
it without the weights, validates too. Validation only: nothing is trained or loaded.
"""

import re
from pathlib import Path

import pytest
import yaml

from hone.cli import main
from hone.models.hub import parse_hub_id

ROOT = Path(__file__).resolve().parents[2]


EXAMPLES = sorted((ROOT / "examples").glob("*.yml"))
PRESET_LINE = re.compile(r"^\s*#\s*preset:\s*(\S+)\s*$", re.MULTILINE)


def _hub_examples() -> list[Path]:
    return [p for p in EXAMPLES if parse_hub_id(str(yaml.safe_load(p.read_text())["model"].get("path", ""))) is not None]


@pytest.fixture
def at_root(monkeypatch, hub_standins):
    monkeypatch.chdir(ROOT)  # the examples' data paths are relative to the repository root


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(example, at_root, capsys):
    assert main(["validate", str(example.relative_to(ROOT))]) == 0, capsys.readouterr().err
    assert "valid" in capsys.readouterr().out


def test_examples_start_from_the_real_models():
    ids = {str(yaml.safe_load(p.read_text())["model"]["path"]) for p in _hub_examples()}
    assert ids >= {"Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct", "openai/gpt-oss-20b", "Qwen/Qwen3-30B-A3B"}


@pytest.mark.parametrize("example", _hub_examples(), ids=lambda p: p.name)
def test_commented_preset_line_validates_without_weights(example, at_root, tmp_path, monkeypatch, capsys):
    """Commenting ``path`` and uncommenting ``preset``, as the example says, gives a valid config
    that needs no model files at all (the stand-in cache is emptied first)."""
    text = example.read_text()
    presets = PRESET_LINE.findall(text)
    assert len(presets) == 1, f"{example.name}: one commented `# preset: NAME` line"
    raw = yaml.safe_load(text)
    raw["model"].pop("path")
    raw["model"]["preset"] = presets[0]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    config = tmp_path / example.name
    config.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(config)]) == 0, capsys.readouterr().err


def test_a_real_id_needs_the_cache(monkeypatch, tmp_path, capsys):
    """The stand-in is what makes them pass: without it the id is reported, not ignored."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["validate", "examples/long-context.yml"]) == 2
    assert "Qwen/Qwen3-8B" in capsys.readouterr().err


def test_gpt_oss_example_validates_and_plans_its_experts_as_shipped_mxfp4(at_root, capsys):
    """The stand-in carries openai/gpt-oss-20b's real quantization_config: validate and plan both say
    the experts stay MXFP4, and the plan counts them at MXFP4's bytes and runs them in hone's kernels."""
    assert main(["validate", "examples/gpt-oss-20b-lora.yml"]) == 0
    assert "experts in MXFP4 as shipped" in capsys.readouterr().out
    assert main(["plan", "examples/gpt-oss-20b-lora.yml", "--gpu-memory", "80GiB"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "experts in MXFP4 (as shipped; 19.11B weights at 0.53125 B)" in out
    assert "experts hone (auto)" in out and "quantize on openai/gpt-oss-20b ships its experts in MXFP4" in out
