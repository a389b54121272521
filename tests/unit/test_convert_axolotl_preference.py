"""``hone convert`` on Axolotl's preference configs (``rl: dpo | ipo | orpo``): the objective and
its keys, each DPO/ORPO dataset type that maps (and the fields it reads), the types whose rows
hone cannot read the same way (left out, naming the entry, the type and what maps), the other
``rl`` values (refused), and that the converted configs validate. The configs and rows are
written in the shapes Axolotl documents (docs/rlhf.qmd, src/axolotl/prompt_strategies)."""

import pytest
import yaml

from hone.cli import main
from hone.config import parse_config
from hone.convert.axolotl import ConversionRefused, convert_axolotl

BASE = """
base_model: Qwen/Qwen3-0.6B
sequence_len: 1024
micro_batch_size: 2
num_epochs: 1
learning_rate: 5e-7
output_dir: ./outputs/out
adapter: lora
lora_r: 16
lora_alpha: 32
lora_target_linear: true
"""

ULTRA = "datasets:\n  - path: data/ultra.jsonl\n    type: chatml.ultra\n"


def _convert(text: str):
    return convert_axolotl(yaml.safe_load(text))


def _parse(conversion, tmp_path):
    """The converted config through hone's loader, its outputs under ``tmp_path``."""
    training = {**conversion.config.get("training", {}), "output_dir": str(tmp_path)}
    return parse_config(dict(conversion.config, training=training))


@pytest.mark.parametrize(
    ("keys", "training"),
    [
        (
            "rl: dpo\nrl_beta: 0.2\ndpo_label_smoothing: 0.1\n",
            {"objective": "dpo", "preference": {"beta": 0.2, "label_smoothing": 0.1}},
        ),
        ("rl: dpo\ndpo_loss_type: [ipo]\nrl_beta: 0.5\n", {"objective": "ipo", "preference": {"beta": 0.5}}),
        ("rl: dpo\ndpo_loss_type: [sigmoid]\n", {"objective": "dpo"}),
        ("rl: ipo\n", {"objective": "ipo"}),
        ("rl: orpo\norpo_alpha: 0.05\n", {"objective": "orpo", "preference": {"beta": 0.05}}),
        ("rl: dpo\ntrl:\n  beta: 0.3\nrl_beta: 0.2\n", {"objective": "dpo", "preference": {"beta": 0.3}}),
        ("rl: dpo\nprecompute_ref_log_probs: true\n", {"objective": "dpo", "preference": {"reference": "precomputed"}}),
    ],
    ids=["dpo", "dpo-ipo-loss", "dpo-sigmoid", "ipo", "orpo", "trl-beta-wins", "precompute"],
)
def test_rl_and_its_keys_become_the_objective(keys, training):
    conversion = _convert(BASE + keys + ULTRA)
    got = conversion.config["training"]
    assert {k: got[k] for k in ("objective", "preference") if k in got} == training
    lost = {"rl: dpo\ntrl:\n  beta: 0.3\nrl_beta: 0.2\n": ["rl_beta"]}.get(keys, [])
    assert conversion.untranslated_keys == lost  # trl.beta wins over rl_beta, as in Axolotl


def test_sample_packing_is_left_to_the_objective(tmp_path):
    conversion = _convert(BASE + "rl: dpo\nsample_packing: true\neval_sample_packing: false\n" + ULTRA)
    assert "sample_packing" not in conversion.config["data"] and "eval_sample_packing" not in conversion.config["data"]
    assert conversion.untranslated_keys == []
    assert any(n.startswith("sample_packing: not needed (a preference objective packs") for n in conversion.notes)
    _parse(conversion, tmp_path)  # hone refuses data.sample_packing with a preference objective


def test_keys_without_a_counterpart_are_listed_and_those_hone_does_itself_noted():
    keys = "rl: ipo\ndpo_label_smoothing: 0.1\ndpo_use_weighting: true\nrpo_alpha: 1.0\ndpo_padding_free: true\n"
    conversion = _convert(BASE + keys + ULTRA)
    assert conversion.untranslated_keys == ["dpo_label_smoothing", "dpo_use_weighting", "rpo_alpha"]
    assert "label smoothing applies to DPO only" in conversion.untranslated[0].reason
    assert any(n.startswith("dpo_padding_free: not needed") for n in conversion.notes)


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ("rl: kto\n", ["rl: kto", "dpo, ipo, orpo"]),
        ("rl: simpo\n", ["rl: simpo", "dpo, ipo, orpo"]),
        ("rl: grpo\n", ["rl: grpo", "dpo, ipo, orpo"]),
        ("rl: dpo\ndpo_loss_type: [hinge]\n", ["dpo_loss_type: ['hinge']", "sigmoid", "ipo"]),
        ("rl: dpo\ndpo_loss_type: [sigmoid, bco_pair]\n", ["dpo_loss_type:", "one at a time"]),
    ],
)
def test_other_rl_objectives_are_refused_naming_the_value_and_the_supported_ones(keys, named, tmp_path, capsys):
    with pytest.raises(ConversionRefused) as info:
        _convert(BASE + keys + ULTRA)
    for words in named:
        assert words in str(info.value)
    source, out = tmp_path / "axolotl.yml", tmp_path / "hone.yml"
    source.write_text(BASE + keys + ULTRA)
    assert main(["convert", str(source), "-o", str(out)]) == 2
    assert named[0] in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize(
    ("dataset", "entry", "template"),
    [
        ("type: chatml.ultra", {"type": "preference", "field_prompt": None}, "chatml"),
        ("type: chatml.argilla_chat", {"type": "preference", "field_prompt": None}, "chatml"),
        ("type: llama3.ultra", {"type": "preference", "field_prompt": None}, "llama3"),
        ("type: llama3.argilla_chat", {"type": "preference", "field_prompt": None}, "llama3"),
        ("type: passthrough", {"type": "preference"}, None),
        (
            "type: chat_template.default\n    field_messages: conversation\n    field_chosen: good\n    field_rejected: bad\n"
            "    message_property_mappings: {role: from, content: value}\n    roles: {user: [human], assistant: [gpt]}",
            {
                "type": "preference",
                "field_prompt": "conversation",
                "field_chosen": "good",
                "field_rejected": "bad",
                "field_role": "from",
                "field_content": "value",
                "role_map": {"human": "user", "gpt": "assistant"},
            },
            None,
        ),
        ("type: chat_template", {"type": "preference", "field_prompt": "messages"}, None),
        (
            "type: chat_template.argilla_chat\n    chat_template: qwen3",
            {"type": "preference", "field_prompt": None},
            "qwen3",
        ),
        ("type: chat_template.argilla", {"type": "preference", "field_prompt": None}, None),
        (
            "type:\n      field_prompt: question\n      field_chosen: good\n      field_rejected: bad\n"
            "      prompt_format: '{prompt}'",
            {"type": "preference", "field_prompt": "question", "field_chosen": "good", "field_rejected": "bad"},
            None,
        ),
    ],
    ids=[
        "chatml.ultra",
        "chatml.argilla_chat",
        "llama3.ultra",
        "llama3.argilla_chat",
        "passthrough",
        "chat_template.default",
        "chat_template",
        "chat_template.argilla_chat",
        "orpo-chat_template.argilla",
        "user_defined",
    ],
)
def test_preference_dataset_types_map(dataset, entry, template, tmp_path):
    conversion = _convert(BASE + f"rl: dpo\ndatasets:\n  - path: data/pairs.jsonl\n    {dataset}\n")
    assert conversion.config["data"]["datasets"] == [{"path": "data/pairs.jsonl", **entry}]
    assert conversion.config["data"].get("chat_template") == template
    assert conversion.untranslated_keys == []
    cfg = _parse(conversion, tmp_path)
    assert cfg.data.datasets[0].type == "preference" and cfg.data.datasets[0].field_prompt == entry.get("field_prompt", "prompt")


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("chatml.intel", ["wraps text fields in chatml turns", "data.chat_template: chatml"]),
        ("chatml.icr", ["wraps text fields in chatml turns"]),
        ("chatml.prompt_pairs", ["wraps text fields in chatml turns"]),
        ("chatml", ["'chatml.default' wraps text fields in chatml turns"]),
        ("chatml.argilla", ["wraps text fields in chatml turns"]),
        ("llama3.intel", ["wraps text fields in llama3 turns", "data.chat_template: llama3"]),
        ("zephyr.nectar", ["'zephyr.nectar' has no hone counterpart", "chatml.ultra"]),
        ("alpaca", ["'alpaca.default' has no hone counterpart"]),
    ],
)
def test_types_hone_cannot_read_the_same_way_are_left_out_naming_entry_and_type(kind, words):
    text = BASE + f"rl: dpo\ndatasets:\n  - path: data/ultra.jsonl\n    type: chatml.ultra\n  - path: d.jsonl\n    type: {kind}\n"
    conversion = _convert(text)
    assert len(conversion.config["data"]["datasets"]) == 1
    (lost,) = conversion.untranslated
    assert lost.key == "datasets[1]" and all(w in lost.reason for w in words)
    with pytest.raises(ConversionRefused) as info:  # nothing left to train on
        _convert(BASE + f"rl: dpo\ndatasets:\n  - path: d.jsonl\n    type: {kind}\n")
    assert "datasets[0]: type" in str(info.value)


def test_a_user_defined_type_with_format_strings_is_left_out():
    text = BASE + "rl: dpo\ndatasets:\n  - path: a.jsonl\n    type: chatml.ultra\n  - path: d.jsonl\n    type:\n"
    text += "      field_prompt: q\n      prompt_format: '[INST] {prompt} [/INST]'\n"
    (lost,) = _convert(text).untranslated
    assert lost.key == "datasets[1]" and "prompt_format: '[INST] {prompt} [/INST]'" in lost.reason


def test_a_second_template_for_one_run_is_listed():
    text = BASE + "rl: dpo\ndatasets:\n  - path: a.jsonl\n    type: chatml.ultra\n  - path: b.jsonl\n    type: llama3.ultra\n"
    conversion = _convert(text)
    assert conversion.config["data"]["chat_template"] == "chatml"
    assert conversion.untranslated_keys == ["datasets[1].type"]


def test_eval_datasets_map_as_pairs_too(tmp_path):
    text = BASE + "rl: orpo\n" + ULTRA + "test_datasets:\n  - path: data/held_out.jsonl\n    type: chatml.ultra\n"
    conversion = _convert(text)
    assert conversion.config["data"]["test_datasets"] == [
        {"path": "data/held_out.jsonl", "type": "preference", "field_prompt": None}
    ]
    cfg = _parse(conversion, tmp_path)
    assert cfg.data.test_datasets[0].type == "preference"


def test_axolotls_documented_dpo_and_orpo_configs_convert_and_validate(tmp_path):
    dpo = BASE + "rl: dpo\nrl_beta: 0.1\n" + ULTRA
    orpo = BASE + "rl: orpo\norpo_alpha: 0.1\nremove_unused_columns: false\nchat_template: chatml\n"
    orpo += "datasets:\n  - path: data/ultra.jsonl\n    type: chat_template.argilla\n"
    for text in (dpo, orpo):
        conversion = _convert(text)
        assert conversion.untranslated_keys == []
        cfg = _parse(conversion, tmp_path)
        assert cfg.data.chat_template == "chatml" and cfg.adapter.type == "lora"


@pytest.mark.parametrize(
    "keys", ["rl: dpo\nrl_beta: 0.2\ndpo_label_smoothing: 0.1\n", "rl: ipo\n", "rl: orpo\norpo_alpha: 0.05\n"]
)
def test_converted_preference_configs_validate_with_the_objective(keys, tmp_path, capsys):
    conversion = _convert(BASE + keys + ULTRA)
    cfg = _parse(conversion, tmp_path)
    assert cfg.training.objective == conversion.config["training"]["objective"]
    source, out = tmp_path / "axolotl.yml", tmp_path / "hone.yml"
    source.write_text(BASE + keys + ULTRA)
    assert main(["convert", str(source), "-o", str(out)]) == 0
    assert ": valid" in capsys.readouterr().out
