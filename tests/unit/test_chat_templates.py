"""Named chat templates (``data.chat_template: chatml``): each renders a known conversation to
the family's published format, marks the reply (and its end-of-turn token) as trained, and a
value that is neither a name nor Jinja is refused when the config is validated."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from hone.config import parse_config
from hone.config.data import CHAT_TEMPLATE_NAMES, ChatDataset
from hone.config.errors import ConfigError
from hone.data.chat import ChatFormat
from hone.data.chat_templates import TEMPLATES
from hone.data.formats import Source

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "How are you?"},
    {"role": "assistant", "content": "Fine."},
]

#: name -> (bos, eos, the end-of-turn special token, the full rendering of CHAT, the generation prompt after it)
EXPECTED = {
    "chatml": (
        "<s>",
        "<|im_end|>",
        "<|im_end|>",
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\nFine.<|im_end|>\n",
        "<|im_start|>assistant\n",
    ),
    "llama3": (
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|eot_id|>",
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nFine.<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "qwen3": (
        "",
        "<|im_end|>",
        "<|im_end|>",
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n"
        "<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nFine.<|im_end|>\n",
        "<|im_start|>assistant\n",
    ),
    "mistral": (
        "<s>",
        "</s>",
        "</s>",
        "<s>[INST] Be brief.\n\nHi [/INST]Hello</s>[INST] How are you? [/INST]Fine.</s>",
        "",
    ),
    "gemma": (
        "<bos>",
        "<eos>",
        "<end_of_turn>",
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\nFine.<end_of_turn>\n",
        "<start_of_turn>model\n",
    ),
}


def render(name: str, messages: list[dict], bos: str, eos: str, add_generation_prompt: bool = False, **extra) -> str:
    rendered, _ = render_jinja_template(
        conversations=[messages],
        chat_template=TEMPLATES[name],
        add_generation_prompt=add_generation_prompt,
        bos_token=bos,
        eos_token=eos,
        **extra,
    )
    return rendered[0]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_template_renders_the_published_format(name):
    bos, eos, _, full, prompt = EXPECTED[name]
    assert render(name, CHAT, bos, eos) == full
    asking = render(name, CHAT[:4], bos, eos)
    assert full.startswith(asking)  # a prefix of the conversation renders to a prefix of the text
    assert render(name, CHAT[:4], bos, eos, add_generation_prompt=True) == asking + prompt


def test_qwen_variants_and_qwen3_reasoning():
    chat = CHAT[1:3]
    assert render("qwen2", chat, "", "<|im_end|>") == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n"
    )
    assert render("qwen2.5", chat, "", "<|im_end|>").startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    )
    assert render("qwen2", CHAT[:3], "", "") == render("chatml", CHAT[:3], "", "")  # a system message replaces the default
    thinking = [chat[0], {**chat[1], "reasoning_content": "They greet me.\n"}]
    assert render("qwen3", thinking, "", "") == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nThey greet me.\n</think>\n\nHello<|im_end|>\n"
    )
    assert render("qwen3", chat[:1], "", "", add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def fake_tokenizer(bos: str, eos: str, end_of_turn: str) -> SimpleNamespace:
    specials = {i: SimpleNamespace(content=t, special=True) for i, t in enumerate({bos, eos, end_of_turn} - {""})}
    return SimpleNamespace(special_tokens_map={"bos_token": bos, "eos_token": eos}, added_tokens_decoder=specials)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_template_trains_each_reply_and_its_end_of_turn_token(name):
    bos, eos, end_of_turn, full, _ = EXPECTED[name]
    cfg = ChatDataset(path=Path("chat.jsonl"), type="chat")
    fmt = ChatFormat(cfg, Source(Path("chat.jsonl"), "data.datasets[0]"), fake_tokenizer(bos, eos, end_of_turn), name)
    row = fmt.render({"messages": CHAT})
    assert row.text == full
    thinks = "<think>\n\n</think>\n\n" if name == "qwen3" else ""
    assert [row.text[a:b] for a, b in row.trained] == [f"{thinks}Hello{end_of_turn}", f"{thinks}Fine.{end_of_turn}"]


def test_every_name_the_config_accepts_has_a_template():
    assert sorted(CHAT_TEMPLATE_NAMES) == sorted(TEMPLATES)


def data_config(**data) -> dict:
    return {"model": {"preset": "tiny-llama"}, "data": {"datasets": [{"path": "chat.jsonl", "type": "chat"}], **data}}


@pytest.mark.parametrize(
    "value", ["chatml", "Llama3", "qwen3", "{{ messages[0]['content'] }}", "{% for m in messages %}x{% endfor %}"]
)
def test_names_and_jinja_are_accepted(value):
    assert parse_config(data_config(chat_template=value)).data.chat_template == value


def test_a_value_that_is_neither_a_name_nor_jinja_is_refused_with_the_names():
    with pytest.raises(ConfigError) as info:
        parse_config(data_config(chat_template="chatmll"))
    message = str(info.value)
    assert "data.chat_template" in message and "'chatmll'" in message
    assert "did you mean 'chatml'?" in message
    assert "llama3" in message and "qwen3" in message and "gemma" in message


@pytest.mark.parametrize("kind", ["chat_template", "sharegpt", "chats"])
def test_near_miss_dataset_types_suggest_chat(kind):
    raw = data_config()
    raw["data"]["datasets"][0]["type"] = kind
    with pytest.raises(ConfigError, match=r"did you mean 'chat'\?"):
        parse_config(raw)


def test_sharegpt_rows_and_type_point_at_the_mapping_in_the_docs(tmp_path, write_jsonl, make_data_config, tokenizer):
    from hone.data.errors import DataError
    from hone.data.prepare import prepare_data

    rows = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}]
    path = write_jsonl(tmp_path, rows)
    with pytest.raises(
        DataError, match=r"field_messages: conversations, field_role: from, field_content: value.*docs/datasets.md"
    ):
        prepare_data(make_data_config([{"path": path, "type": "chat"}]), tokenizer)
    mapped = {"path": path, "type": "chat", "field_messages": "conversations"}
    with pytest.raises(DataError, match=r"'role' is null.*field_role: from.*docs/datasets.md"):
        prepare_data(make_data_config([mapped]), tokenizer)
    raw = data_config()
    raw["data"]["datasets"][0]["type"] = "sharegpt"
    with pytest.raises(ConfigError, match=r"did you mean 'chat'\? ShareGPT rows .* docs/datasets.md"):
        parse_config(raw)
    sharegpt = {**mapped, "field_role": "from", "field_content": "value", "role_map": {"human": "user", "gpt": "assistant"}}
    assert len(prepare_data(make_data_config([sharegpt]), tokenizer).train) == 1


def test_generate_and_chat_wrap_prompts_with_the_named_template():
    from hone.export.load import prompt_setup

    setup = prompt_setup(parse_config(data_config(chat_template="llama3")))
    assert setup.style == "chat" and setup.chat_template == TEMPLATES["llama3"]
    assert prompt_setup(parse_config(data_config())).chat_template is None  # the tokenizer's own
