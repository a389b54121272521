"""Formats: exactly which tokens each format trains, EOS handling, chat roles and templates."""

from __future__ import annotations

import random
import string

import pytest

from hone.data.errors import DataError
from hone.data.prepare import prepare_data

BOS, EOS = "<|begin_of_text|>", "<|im_end|>"

_WORDS = ["lemon", "Veloria", "river", "naïve", "über", "日本", "emoji🎉", "x", "42", "3.14", "don't", "C++", "a-b"]


def random_text(rng: random.Random, words: int) -> str:
    """Random words joined by varied whitespace and punctuation; starts and ends with a word."""
    parts = [rng.choice(_WORDS + ["".join(rng.choices(string.ascii_letters, k=rng.randint(1, 9)))]) for _ in range(words)]
    text = parts[0]
    for part in parts[1:]:
        text += rng.choice([" ", " ", "  ", ", ", ".\n", "\n\n", "\t", "? "]) + part
    return text


def rows_by_content(prepared, tokenizer) -> dict[str, dict]:
    return {tokenizer.decode(r["input_ids"]): r for r in prepared.train}


def test_alpaca_trains_exactly_the_output_and_an_appended_eos(tmp_path, write_jsonl, make_data_config, tokenizer, trained_spans):
    rng = random.Random(0)
    rows = []
    for i in range(40):
        row = {"instruction": random_text(rng, rng.randint(1, 8)), "output": f"out{i} " + random_text(rng, rng.randint(1, 6))}
        if i % 3:
            row["input"] = random_text(rng, rng.randint(1, 4)) if i % 3 == 1 else ""
        rows.append(row)
    path = write_jsonl(tmp_path, rows)
    prepared = prepare_data(make_data_config([{"path": path, "type": "alpaca"}], sequence_len=512), tokenizer)
    assert len(prepared.train) == len(rows)
    assert prepared.train.column_names == ["input_ids", "labels", "length"]
    by_text = rows_by_content(prepared, tokenizer)
    for row in rows:
        if row.get("input"):
            prompt = f"### Instruction:\n{row['instruction']}\n\n### Input:\n{row['input']}\n\n### Response:\n"
        else:
            prompt = f"### Instruction:\n{row['instruction']}\n\n### Response:\n"
        encoded = by_text[BOS + prompt + row["output"] + EOS]
        assert trained_spans(tokenizer, encoded) == [row["output"] + EOS]
        assert encoded["input_ids"][-1] == tokenizer.eos_token_id == encoded["labels"][-1]
        assert encoded["labels"][0] == -100
        assert encoded["length"] == len(encoded["input_ids"]) == len(encoded["labels"])


def test_alpaca_field_names_come_from_the_config(tmp_path, write_jsonl, make_data_config, tokenizer, trained_spans):
    path = write_jsonl(tmp_path, [{"q": "What color is a lemon?", "a": "yellow"}, {"q": "Capital of Veloria?", "a": "Amberfall"}])
    cfg = make_data_config([{"path": path, "type": "alpaca", "field_instruction": "q", "field_output": "a"}])
    prepared = prepare_data(cfg, tokenizer)
    assert sorted(trained_spans(tokenizer, r)[0] for r in prepared.train) == ["Amberfall" + EOS, "yellow" + EOS]


def test_completion_trains_every_token_after_the_first(tmp_path, write_jsonl, make_data_config, tokenizer):
    rng = random.Random(1)
    texts = [random_text(rng, rng.randint(1, 30)) for _ in range(30)]
    path = write_jsonl(tmp_path, [{"body": t} for t in texts])
    prepared = prepare_data(
        make_data_config([{"path": path, "type": "completion", "field_text": "body"}], sequence_len=1024), tokenizer
    )
    by_text = rows_by_content(prepared, tokenizer)
    for text in texts:
        row = by_text[BOS + text + EOS]
        assert row["input_ids"][0] == tokenizer.bos_token_id and row["input_ids"][-1] == tokenizer.eos_token_id
        assert row["labels"][0] == -100
        assert row["labels"][1:] == row["input_ids"][1:]
    assert prepared.stats.train.trained_tokens == prepared.stats.train.tokens - len(texts)


def test_pretokenized_keeps_ids_and_labels_and_adds_nothing(tmp_path, write_jsonl, make_data_config, tokenizer):
    rng = random.Random(2)
    rows = []
    for _ in range(25):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(2, 40))]
        labels = [t if rng.random() < 0.6 else -100 for t in ids]
        labels[-1] = ids[-1]  # at least one trained token
        rows.append({"input_ids": ids, "labels": labels})
    with_labels = write_jsonl(tmp_path, rows, "with.jsonl")
    without_labels = write_jsonl(tmp_path, [{"input_ids": r["input_ids"]} for r in rows], "without.jsonl")
    prepared = prepare_data(make_data_config([{"path": with_labels, "type": "pretokenized"}]), tokenizer)
    got = {tuple(r["input_ids"]): r["labels"] for r in prepared.train}
    for row in rows:
        assert got[tuple(row["input_ids"])] == [-100] + row["labels"][1:]
    prepared = prepare_data(make_data_config([{"path": without_labels, "type": "pretokenized"}]), tokenizer)
    for r in prepared.train:
        assert r["labels"] == [-100] + r["input_ids"][1:]


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"input_ids": [5, 2048, 7]}, "item 1 is 2048, outside the tokenizer's vocabulary (expected integers in [0, 2048))"),
        ({"input_ids": [5, -3]}, "item 1 is -3"),
        ({"input_ids": [5, 6.5]}, "item 1 is a number (6.5)"),
        ({"input_ids": "5 6"}, "'input_ids' is a string"),
        ({"input_ids": []}, "is an empty list"),
        ({"input_ids": [5, 6, 7], "labels": [5, 6]}, "has 2 labels but 'input_ids' has 3 ids"),
        ({"input_ids": [5, 6], "labels": [5, 9999]}, "field 'labels' item 1 is 9999"),
    ],
)
def test_pretokenized_rejects_bad_ids_naming_file_and_row(tmp_path, write_jsonl, make_data_config, tokenizer, row, expected):
    good = {"input_ids": [5, 6, 7], "labels": [5, 6, 7]}
    path = write_jsonl(tmp_path, [good, good, row])
    with pytest.raises(DataError) as info:
        prepare_data(make_data_config([{"path": path, "type": "pretokenized"}]), tokenizer)
    message = str(info.value)
    assert f"{path} row 3:" in message and expected in message


# ---------------------------------------------------------------- chat


def random_chat(rng: random.Random, system: bool) -> list[dict]:
    messages = [{"role": "system", "content": random_text(rng, 3)}] if system else []
    for turn in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": random_text(rng, rng.randint(1, 6))})
        messages.append({"role": "assistant", "content": f"reply{turn} " + random_text(rng, rng.randint(1, 6))})
    return messages


def chatml(message: dict) -> str:
    return f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>"


@pytest.mark.parametrize("train_on", [["assistant"], ["user", "assistant"], ["system"], ["system", "user", "assistant"]])
def test_chat_trains_exactly_the_roles_in_train_on(tmp_path, write_jsonl, make_data_config, tokenizer, trained_spans, train_on):
    rng = random.Random(3)
    chats = [random_chat(rng, system=i % 2 == 0) for i in range(30)]
    path = write_jsonl(tmp_path, [{"messages": m} for m in chats])
    cfg = make_data_config([{"path": path, "type": "chat", "train_on": train_on}], sequence_len=1024)
    prepared = prepare_data(cfg, tokenizer)
    by_text = rows_by_content(prepared, tokenizer)
    expected_rows = 0
    for messages in chats:
        text = BOS + "".join(chatml(m) + "\n" for m in messages)
        expected = []
        for m in messages:
            if m["role"] not in train_on:
                continue
            if m["role"] == "assistant":  # the header a reply is generated after is context
                expected.append(m["content"] + EOS)
            else:
                expected.append(chatml(m))
        if not expected:
            assert text not in by_text  # nothing to train: dropped
            continue
        expected_rows += 1
        assert trained_spans(tokenizer, by_text[text]) == expected
    assert len(prepared.train) == expected_rows
    assert prepared.stats.sources[0].dropped_no_trained == len(chats) - expected_rows


def test_chat_role_map_and_field_names(tmp_path, write_jsonl, make_data_config, tokenizer, trained_spans):
    rows = [
        {"conversations": [{"from": "human", "value": "What color is a lemon?"}, {"from": "gpt", "value": "yellow"}]},
        {
            "conversations": [
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello"},
                {"from": "human", "value": "Bye"},
                {"from": "gpt", "value": "Goodbye"},
            ]
        },
    ]
    path = write_jsonl(tmp_path, rows)
    cfg = make_data_config(
        [
            {
                "path": path,
                "type": "chat",
                "field_messages": "conversations",
                "field_role": "from",
                "field_content": "value",
                "role_map": {"human": "user", "gpt": "assistant"},
            }
        ]
    )
    prepared = prepare_data(cfg, tokenizer)
    spans = sorted(trained_spans(tokenizer, r) for r in prepared.train)
    assert spans == [["Hello" + EOS, "Goodbye" + EOS], ["yellow" + EOS]]
    text = {tokenizer.decode(r["input_ids"]) for r in prepared.train}
    assert (
        BOS
        + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nGoodbye<|im_end|>\n"  # noqa: E501
        in text
    )


def test_chat_unknown_role_names_file_row_role_and_allowed_roles(tmp_path, write_jsonl, make_data_config, tokenizer):
    rows = [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"messages": [{"role": "human", "content": "a"}, {"role": "assistant", "content": "b"}]},
    ]
    path = write_jsonl(tmp_path, rows)
    with pytest.raises(DataError) as info:
        prepare_data(make_data_config([{"path": path, "type": "chat"}]), tokenizer)
    message = str(info.value)
    assert f"{path} row 2:" in message
    assert "unknown role 'human'" in message and "system, user, assistant, tool" in message
    assert "role_map" in message


def test_chat_role_map_to_unknown_target_is_reported_with_its_source(tmp_path, write_jsonl, make_data_config, tokenizer):
    # role_map values are validated by the config; a role that is not mapped keeps its name.
    path = write_jsonl(tmp_path, [{"messages": [{"role": "bot", "content": "a"}]}])
    cfg = make_data_config([{"path": path, "type": "chat", "role_map": {"human": "user"}}])
    with pytest.raises(DataError, match=r"row 1: message 1: unknown role 'bot'"):
        prepare_data(cfg, tokenizer)


def test_chat_template_that_renders_no_assistant_text_is_an_error_even_when_skipping(
    tmp_path, write_jsonl, make_data_config, tokenizer
):
    path = write_jsonl(tmp_path, [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])
    template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    )
    cfg = make_data_config([{"path": path, "type": "chat"}], chat_template=template, on_bad_row="skip")
    with pytest.raises(DataError) as info:
        prepare_data(cfg, tokenizer)
    message = str(info.value)
    assert f"{path} row 1:" in message
    assert "data.chat_template renders no text for message 2 (assistant)" in message


def test_chat_with_a_plain_text_template_trains_reply_and_its_newline(
    tmp_path, write_jsonl, make_data_config, tokenizer, trained_spans
):
    template = (
        "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant: {% endif %}"
    )
    rng = random.Random(4)
    chats = [random_chat(rng, system=False) for _ in range(20)]
    path = write_jsonl(tmp_path, [{"messages": m} for m in chats])
    prepared = prepare_data(
        make_data_config([{"path": path, "type": "chat"}], chat_template=template, sequence_len=1024), tokenizer
    )
    by_text = rows_by_content(prepared, tokenizer)
    for messages in chats:
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
        # No closing special token: the newline is the end-of-turn signal and is trained. The
        # reply's first token carries the space after "Assistant:" (it overlaps the reply).
        assert trained_spans(tokenizer, by_text[text]) == [f" {m['content']}\n" for m in messages if m["role"] == "assistant"]


def test_chat_template_syntax_error_names_the_key(tmp_path, write_jsonl, make_data_config, tokenizer):
    path = write_jsonl(tmp_path, [{"messages": [{"role": "user", "content": "q"}]}])
    cfg = make_data_config([{"path": path, "type": "chat"}], chat_template="{% for m in messages %}{{ m['content'] }")
    with pytest.raises(DataError, match=r"data.chat_template is not valid Jinja"):
        prepare_data(cfg, tokenizer)


def test_chat_template_raising_for_a_row_is_a_bad_row(tmp_path, write_jsonl, make_data_config, tokenizer):
    template = (
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('system message must come first') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ok = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    bad = {
        "messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]
    }
    path = write_jsonl(tmp_path, [ok, bad, ok])
    with pytest.raises(DataError, match=r"row 2: the chat template refused this conversation: .*system message must come first"):
        prepare_data(make_data_config([{"path": path, "type": "chat"}], chat_template=template), tokenizer)
    prepared = prepare_data(
        make_data_config([{"path": path, "type": "chat"}], chat_template=template, on_bad_row="skip"), tokenizer
    )
    assert len(prepared.train) == 2 and prepared.stats.sources[0].bad_rows_skipped == 1


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ("hello", "field 'messages' is a string ('hello') (expected a list of messages)"),
        ([], "field 'messages' is an empty list"),
        (["hi"], "message 1 is a string ('hi') (expected an object with 'role' and 'content')"),
        ([{"role": "user"}], "message 1: 'content' is null (expected a string)"),
        (
            [{"role": "user", "content": "a"}, {"role": 3, "content": "b"}],
            "message 2: 'role' is a number (3) (expected a string)",
        ),
    ],
)
def test_chat_malformed_rows_name_the_row_and_message(tmp_path, write_jsonl, make_data_config, tokenizer, messages, expected):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path, [good, {"messages": messages}])
    with pytest.raises(DataError) as info:
        prepare_data(make_data_config([{"path": path, "type": "chat"}]), tokenizer)
    assert f"{path} row 2: {expected}" in str(info.value)
