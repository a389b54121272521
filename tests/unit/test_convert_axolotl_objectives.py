"""``hone convert`` on the Axolotl config shapes that used to convert into another training:
RL objectives other than DPO/IPO/ORPO (tests/unit/test_convert_axolotl_preference.py), reward,
multimodal and diffusion configs are refused (exit 2, naming the key and why), a
config whose datasets all drop is refused naming them; and what now maps: pretraining datasets,
legacy alpaca prompt styles, hub ``data_files``, low-bit optimizers, per-epoch cadences and named
chat templates. The configs are written here in the shapes Axolotl documents."""

import pytest
import yaml

from hone.cli import main
from hone.config import load_config, parse_config
from hone.convert.axolotl import ConversionRefused, convert_axolotl, render_conversion

BASE = """
base_model: Qwen/Qwen3-0.6B
sequence_len: 1024
micro_batch_size: 2
num_epochs: 1
learning_rate: 1e-5
output_dir: ./outputs/out
"""

KTO = (
    BASE
    + """
rl: kto
datasets:
  - path: data/prefs.jsonl
    type: chatml.intel
"""
)

VISION = (
    BASE
    + """
processor_type: AutoProcessor
skip_prepare_dataset: true
remove_unused_columns: false
chat_template: qwen2_vl
datasets:
  - path: data/vision_chats.jsonl
    type: chat_template
"""
)

DIFFUSION = (
    BASE
    + """
plugins:
  - axolotl.integrations.diffusion.DiffusionPlugin
datasets:
  - path: data/text.jsonl
    type: completion
"""
)

REWARD = (
    BASE
    + """
model_type: AutoModelForSequenceClassification
num_labels: 1
reward_model: true
datasets:
  - path: data/pairs.jsonl
    type: bradley_terry.chat_template
"""
)

ONLY_CUSTOM = (
    BASE
    + """
datasets:
  - path: data/qa.jsonl
    type: input_output
  - path: data/dpo.jsonl
    type: chatml.intel
"""
)


def _convert(text: str):
    return convert_axolotl(yaml.safe_load(text))


def _valid(conversion, tmp_path):
    cfg = dict(conversion.config, training={**conversion.config.get("training", {}), "output_dir": str(tmp_path)})
    return parse_config(cfg)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (KTO, ["rl: kto", "dpo, ipo, orpo"]),
        (VISION, ["processor_type: AutoProcessor", "multimodal"]),
        (DIFFUSION, ["plugins: axolotl.integrations.diffusion.DiffusionPlugin", "diffusion"]),
        (REWARD, ["reward_model: true", "model_type: AutoModelForSequenceClassification"]),
    ],
    ids=["kto", "multimodal", "diffusion", "reward"],
)
def test_other_objectives_and_modalities_are_refused_not_converted(text, named, tmp_path, capsys):
    with pytest.raises(ConversionRefused) as info:
        _convert(text)
    for words in named:
        assert words in str(info.value)
    source, out = tmp_path / "axolotl.yml", tmp_path / "hone.yml"
    source.write_text(text)
    assert main(["convert", str(source), "-o", str(out)]) == 2
    assert named[0] in capsys.readouterr().err
    assert not out.exists()  # nothing written: there is no hone config of this training


def test_a_config_whose_datasets_all_drop_is_refused_naming_them(tmp_path, capsys):
    with pytest.raises(ConversionRefused) as info:
        _convert(ONLY_CUSTOM)
    message = str(info.value)
    assert "datasets[0]: type 'input_output' has no hone dataset type" in message
    assert "datasets[1]: type 'chatml.intel'" in message
    assert "at least 1 item" not in message
    source = tmp_path / "axolotl.yml"
    source.write_text(BASE)  # no datasets at all
    assert main(["convert", str(source), "-o", str(tmp_path / "hone.yml")]) == 2
    assert "no training dataset converts" in capsys.readouterr().err


def test_pretraining_dataset_becomes_packed_completion(tmp_path):
    conversion = _convert(
        BASE.replace("num_epochs: 1\n", "max_steps: 1000\n")  # Axolotl's streaming runs have no epochs
        + """
pretraining_dataset:
  - path: json
    data_files: data/corpus.jsonl
    type: pretrain
    text_column: body
pretrain_multipack_attn: true
"""
    )
    data = conversion.config["data"]
    assert data["datasets"] == [{"path": "data/corpus.jsonl", "type": "completion", "field_text": "body"}]
    assert data["sample_packing"] is True
    assert conversion.untranslated_keys == []
    assert any(n.startswith("pretraining_dataset -> data.datasets of type completion") for n in conversion.notes)
    cfg = _valid(conversion, tmp_path)
    assert cfg.data.datasets[0].type == "completion" and cfg.data.sample_packing
    plain = _convert(BASE + "pretraining_dataset: data/web.jsonl\n")  # the old one-path form
    assert plain.config["data"]["datasets"] == [{"path": "data/web.jsonl", "type": "completion"}]


@pytest.mark.parametrize("style", ["alpaca:chat", "alpaca:phi", "alpaca:chatml", "alpaca_chat"])
def test_legacy_alpaca_prompt_styles_become_alpaca_with_a_note(style, tmp_path):
    conversion = _convert(BASE + f"datasets:\n  - path: data/alpaca.jsonl\n    type: {style}\n")
    assert conversion.config["data"]["datasets"] == [{"path": "data/alpaca.jsonl", "type": "alpaca"}]
    assert conversion.untranslated_keys == []
    assert any(n.startswith(f"datasets[0].type: {style} -> alpaca") and "prompt" in n for n in conversion.notes)
    _valid(conversion, tmp_path)


def test_hub_dataset_data_files_become_hf_paths(tmp_path):
    conversion = _convert(
        BASE
        + """
datasets:
  - path: OrgName/chat-data
    data_files: train/part-0.jsonl
    revision: v2
    type: chat_template
  - path: mlabonne/FineTome-100k
    data_files: [a.parquet, b.parquet]
    type: alpaca
"""
    )
    assert [d["path"] for d in conversion.config["data"]["datasets"]] == [
        "hf://datasets/OrgName/chat-data@v2/train/part-0.jsonl",
        "hf://datasets/mlabonne/FineTome-100k/a.parquet",
        "hf://datasets/mlabonne/FineTome-100k/b.parquet",
    ]
    assert conversion.untranslated_keys == []
    cfg = _valid(conversion, tmp_path)
    assert [d.type for d in cfg.data.datasets] == ["chat", "alpaca", "alpaca"]


@pytest.mark.parametrize(
    ("axolotl", "hone"),
    [
        ("adamw_bnb_8bit", "adamw_8bit"),
        ("adamw_8bit", "adamw_8bit"),
        ("paged_adamw_8bit", "adamw_8bit"),
        ("adamw_torch_8bit", "adamw_8bit"),
        ("adamw_torch_4bit", "adamw_4bit"),
        ("paged_adamw_32bit", "adamw"),
        ("adamw_torch_fused", "adamw"),
    ],
)
def test_low_bit_optimizers_map(axolotl, hone, tmp_path):
    pytest.importorskip("torchao")
    conversion = _convert(BASE + f"optimizer: {axolotl}\ndatasets:\n  - path: d.jsonl\n    type: alpaca\n")
    assert conversion.config["optimizer"].get("name", "adamw") == hone
    assert "optimizer" not in conversion.untranslated_keys
    assert _valid(conversion, tmp_path).optimizer.name == hone


def test_an_optimizer_hone_lacks_is_listed():
    conversion = _convert(BASE + "optimizer: lion_8bit\ndatasets:\n  - path: d.jsonl\n    type: alpaca\n")
    assert conversion.untranslated_keys == ["optimizer"] and "name" not in conversion.config.get("optimizer", {})


def test_saves_and_evals_per_epoch_map(tmp_path):
    data = "datasets:\n  - path: d.jsonl\n    type: alpaca\nval_set_size: 0.05\n"
    conversion = _convert(BASE + data + "saves_per_epoch: 4\nevals_per_epoch: 2\n")
    assert {k: conversion.config["training"][k] for k in ("saves_per_epoch", "evals_per_epoch")} == {
        "saves_per_epoch": 4,
        "evals_per_epoch": 2,
    }
    cfg = _valid(conversion, tmp_path)
    assert (cfg.training.saves_per_epoch, cfg.training.evals_per_epoch) == (4, 2)
    both = _convert(BASE + data + "save_steps: 100\nsaves_per_epoch: 4\neval_strategy: epoch\n")
    assert both.config["training"]["save_steps"] == 100 and "saves_per_epoch" not in both.config["training"]
    assert both.untranslated_keys == ["saves_per_epoch"]  # hone takes one of the two; the steps win
    assert both.config["training"]["evals_per_epoch"] == 1  # eval_strategy: epoch
    _valid(both, tmp_path)


@pytest.mark.parametrize("name", ["llama3", "gemma3", "qwen3", "qwen_25", "chatml"])
def test_named_chat_templates_stay_names(name):
    conversion = _convert(BASE + f"chat_template: {name}\ndatasets:\n  - path: d.jsonl\n    type: chat_template\n")
    assert conversion.config["data"]["chat_template"] == name
    assert conversion.untranslated_keys == []
    header = render_conversion(conversion, "a.yml")
    assert f"chat_template: {name}" in header


def test_converted_pretraining_config_validates_through_the_cli(tmp_path, capsys):
    source, out = tmp_path / "axolotl.yml", tmp_path / "hone.yml"
    source.write_text(BASE + "pretraining_dataset:\n  - path: data/web.jsonl\n    type: pretrain\n")
    assert main(["convert", str(source), "-o", str(out)]) == 0
    assert load_config(out).data.datasets[0].type == "completion"


@pytest.mark.parametrize("name", ["falcon_h1", "phi_3", "mistral_v1"])
def test_a_template_name_hone_does_not_ship_is_left_to_the_tokenizer_and_listed(tmp_path, capsys, name):
    """Axolotl's named templates copy the model's own: unset, the tokenizer's renders the chats; the
    note says so and names hone's templates (Axolotl's examples: 30 of 252 named one hone lacks)."""
    source, out = tmp_path / "axolotl.yml", tmp_path / "hone.yml"
    source.write_text(BASE + f"chat_template: {name}\ndatasets:\n  - path: d.jsonl\n    type: chat_template\n")
    assert main(["convert", str(source), "-o", str(out)]) == 0
    assert load_config(out).data.chat_template is None
    printed = capsys.readouterr()
    assert f"chat_template: '{name}' is not a template hone ships (chatml," in printed.out + printed.err
    assert "tokenizer's own template" in out.read_text()


def test_a_bare_hub_dataset_id_stays_an_id_with_its_split_and_revision(tmp_path):
    conversion = _convert(
        BASE
        + """
datasets:
  - path: tatsu-lab/alpaca
    type: alpaca
  - path: OrgName/chats
    revision: 1a2b3c
    split: validation
    type: chat_template
  - path: OrgName/more
    split: train[:10%]
    type: alpaca
"""
    )
    assert conversion.config["data"]["datasets"] == [
        {"path": "tatsu-lab/alpaca", "type": "alpaca"},
        {"path": "OrgName/chats@1a2b3c", "split": "validation", "type": "chat"},
        {"path": "OrgName/more", "type": "alpaca"},
    ]
    assert conversion.untranslated_keys == ["datasets[2].split"]  # no slices: the whole split
    assert any("hf download tatsu-lab/alpaca --repo-type dataset" in n for n in conversion.notes)
    assert [d.split for d in _valid(conversion, tmp_path).data.datasets] == [None, "validation", None]


@pytest.mark.parametrize(
    "rope",
    [
        "overrides_of_model_config:\n  rope_scaling: {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}\n",
        "rope_scaling:\n  type: yarn\n  factor: 4.0\n  original_max_position_embeddings: 32768\n",
    ],
)
def test_rope_scaling_maps_to_model_rope_scaling(tmp_path, rope):
    conversion = _convert(BASE + rope + "datasets:\n  - path: d.jsonl\n    type: alpaca\n")
    assert conversion.config["model"]["rope_scaling"] == {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    assert conversion.untranslated_keys == []
