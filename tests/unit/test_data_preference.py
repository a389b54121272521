"""Preference pairs (``type: preference``): text and chat rows, field options, bad rows,
length policy, the cache, ``hone preprocess`` and the refusals of validate/train."""

from __future__ import annotations

from pathlib import Path

import pytest

from hone.cli import main
from hone.config import ConfigError, parse_config
from hone.data.errors import DataError
from hone.data.preference_encode import PREFERENCE_COLUMNS
from hone.data.prepare import prepare_data

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "preference_sample.jsonl"


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def pairs(prepared) -> list[dict]:
    """The train split's pairs in file order (one pair per distinct prompt + chosen)."""
    return prepared.train.to_list()


def prepare(make_data_config, tokenizer, path: Path, use_cache: bool = False, **options):
    entry = {"path": path, "type": "preference", **options.pop("entry", {})}
    return prepare_data(make_data_config([entry], **options), tokenizer, use_cache=use_cache)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_text_rows_become_prompt_and_completion_ids(tmp_path, write_jsonl, make_data_config, tokenizer):
    path = write_jsonl(tmp_path, [{"prompt": "What color is a lemon?", "chosen": " yellow", "rejected": " blue"}])
    (pair,) = pairs(prepare(make_data_config, tokenizer, path))
    assert list(pair) == list(PREFERENCE_COLUMNS)
    eos = tokenizer.eos_token_id
    assert pair["prompt_ids"] == [tokenizer.bos_token_id, *ids(tokenizer, "What color is a lemon?")]
    assert pair["chosen_ids"] == [*ids(tokenizer, " yellow"), eos]
    assert pair["rejected_ids"] == [*ids(tokenizer, " blue"), eos]
    assert pair["length"] == len(pair["prompt_ids"]) + max(len(pair["chosen_ids"]), len(pair["rejected_ids"]))


def test_chat_rows_with_explicit_or_implicit_prompt_give_the_same_ids(tmp_path, write_jsonl, make_data_config, tokenizer):
    prompt = [{"role": "system", "content": "Answer briefly."}, user("What color is a lemon?")]
    explicit = {"prompt": prompt, "chosen": [assistant("yellow")], "rejected": [assistant("blue")]}
    implicit = {"chosen": [*prompt, assistant("yellow")], "rejected": [*prompt, assistant("blue")]}
    got = [
        pairs(prepare(make_data_config, tokenizer, write_jsonl(tmp_path, [row], name=f"{i}.jsonl")))[0]
        for i, row in enumerate([explicit, implicit])
    ]
    assert got[0] == got[1]
    want_prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert got[0]["prompt_ids"] == ids(tokenizer, want_prompt)  # the template once, with the generation prompt
    assert tokenizer.decode(got[0]["chosen_ids"]) == "yellow" + tokenizer.eos_token  # the turn, up to its end token
    assert tokenizer.decode(got[0]["rejected_ids"]) == "blue" + tokenizer.eos_token
    assert got[0]["chosen_ids"][-1] == tokenizer.eos_token_id  # not appended twice


def test_implicit_prompt_keeps_earlier_assistant_turns_and_stops_before_the_last(
    tmp_path, write_jsonl, make_data_config, tokenizer
):
    history = [user("hi"), assistant("hello"), user("What color is a lime?")]
    row = {"chosen": [*history, assistant("green")], "rejected": [*history, assistant("red")]}
    (pair,) = pairs(prepare(make_data_config, tokenizer, write_jsonl(tmp_path, [row])))
    want = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert pair["prompt_ids"] == ids(tokenizer, want)


def test_field_names_and_role_map_are_configurable(tmp_path, write_jsonl, make_data_config, tokenizer):
    text = write_jsonl(tmp_path, [{"question": "2+2?", "good": " 4", "bad": " 5"}], name="text.jsonl")
    entry = {"field_prompt": "question", "field_chosen": "good", "field_rejected": "bad"}
    (pair,) = pairs(prepare(make_data_config, tokenizer, text, entry=entry))
    assert pair["chosen_ids"][:-1] == ids(tokenizer, " 4")
    chat_row = {
        "a": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}],
        "b": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "5"}],
    }
    chat = write_jsonl(tmp_path, [chat_row], name="chat.jsonl")
    entry = {
        "field_chosen": "a",
        "field_rejected": "b",
        "field_role": "from",
        "field_content": "value",
        "role_map": {"human": "user", "gpt": "assistant"},
    }
    (pair,) = pairs(prepare(make_data_config, tokenizer, chat, entry=entry))
    assert tokenizer.decode(pair["chosen_ids"]) == "4" + tokenizer.eos_token


def test_a_null_field_prompt_takes_the_shared_turns_even_beside_a_text_prompt_column(
    tmp_path, write_jsonl, make_data_config, tokenizer
):
    """UltraFeedback's rows repeat the user turn as a text ``prompt`` column: with ``field_prompt:
    null`` the column is not read and the pair equals the one without it."""
    row = {
        "chosen": [user("What color is a lime?"), assistant("green")],
        "rejected": [user("What color is a lime?"), assistant("red")],
    }
    plain = pairs(prepare(make_data_config, tokenizer, write_jsonl(tmp_path, [row], name="plain.jsonl")))
    with_column = write_jsonl(tmp_path, [{"prompt": "What color is a lime?", **row}], name="ultra.jsonl")
    with pytest.raises(DataError, match="field 'chosen' is a list"):  # read as text: the prompt is a string
        prepare(make_data_config, tokenizer, with_column)
    assert pairs(prepare(make_data_config, tokenizer, with_column, entry={"field_prompt": None})) == plain
    text = write_jsonl(tmp_path, [{"prompt": "q", "chosen": " a", "rejected": " b"}], name="text.jsonl")
    with pytest.raises(DataError, match="field_prompt is null"):
        prepare(make_data_config, tokenizer, text, entry={"field_prompt": None})


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "q", "chosen": " same", "rejected": " same"}, "'chosen' and 'rejected' are identical"),
        ({"prompt": "q", "chosen": " a", "rejected": None}, "field 'rejected' is null (expected text"),
        ({"prompt": "q", "chosen": 5, "rejected": " b"}, "field 'chosen' is a number (5) (expected text"),
        ({"chosen": [user("q"), assistant("a")], "rejected": [user("q"), assistant("a")]}, "are identical"),
        (
            {"prompt": [user("q")], "chosen": [{"role": "bot", "content": "a"}], "rejected": [assistant("b")]},
            "field 'chosen' message 1: unknown role 'bot'",
        ),
        ({"chosen": [user("q"), assistant("a")], "rejected": [user("other"), assistant("b")]}, "share no prompt turn"),
    ],
)
def test_bad_rows_are_reported_with_file_and_row(tmp_path, write_jsonl, make_data_config, tokenizer, row, message):
    good = {"prompt": "What color is a lemon?", "chosen": " yellow", "rejected": " blue"}
    path = write_jsonl(tmp_path, [good, row, good])
    with pytest.raises(DataError) as info:
        prepare(make_data_config, tokenizer, path)
    assert f"{path} row 2: " in str(info.value) and message in str(info.value)
    assert "data.datasets[0], type preference" in str(info.value)
    skipped = prepare(make_data_config, tokenizer, path, on_bad_row="skip")
    assert skipped.stats.sources[0].bad_rows_skipped == 1 and skipped.stats.train.rows == 2
    assert skipped.stats.sources[0].skipped_examples[0].startswith(f"{path} row 2: ")


def test_a_prompt_that_fills_sequence_len_is_dropped_or_refused(tmp_path, write_jsonl, make_data_config, tokenizer):
    long_prompt = " ".join(["lemon"] * 40)
    rows = [{"prompt": "q", "chosen": " a", "rejected": " b"}, {"prompt": long_prompt, "chosen": " a", "rejected": " b"}]
    path = write_jsonl(tmp_path, rows)
    dropped = prepare(make_data_config, tokenizer, path, sequence_len=16)
    source = dropped.stats.sources[0]
    assert source.dropped_prompt_too_long == 1 and dropped.stats.train.rows == 1
    assert source.dropped_examples[0].startswith(f"{path} row 2: the prompt alone has")
    with pytest.raises(DataError, match=r"row 2: the prompt alone has \d+ tokens.*truncate cuts completions, never the prompt"):
        prepare(make_data_config, tokenizer, path, sequence_len=16, excess_length_strategy="truncate")


def test_a_pair_longer_than_sequence_len_is_dropped_or_its_completions_cut(tmp_path, write_jsonl, make_data_config, tokenizer):
    rows = [
        {"prompt": "q", "chosen": " a", "rejected": " b"},
        {"prompt": "What color?", "chosen": " yellow" * 20, "rejected": " blue"},
    ]
    path = write_jsonl(tmp_path, rows)
    dropped = prepare(make_data_config, tokenizer, path, sequence_len=16)
    assert dropped.stats.sources[0].dropped_too_long == 1 and dropped.stats.train.rows == 1
    cut = prepare(make_data_config, tokenizer, path, sequence_len=16, excess_length_strategy="truncate")
    assert cut.stats.sources[0].truncated == 1
    (pair,) = [p for p in pairs(cut) if len(p["chosen_ids"]) > 2]
    assert len(pair["prompt_ids"]) + len(pair["chosen_ids"]) == 16 and pair["length"] == 16
    assert pair["rejected_ids"] == [*ids(tokenizer, " blue"), tokenizer.eos_token_id]  # short enough: untouched


def test_cache_round_trip_and_the_bundled_sample(make_data_config, tokenizer):
    first = prepare(make_data_config, tokenizer, SAMPLE, use_cache=True, sequence_len=64, val_set_size=0.1)
    second = prepare(make_data_config, tokenizer, SAMPLE, use_cache=True, sequence_len=64, val_set_size=0.1)
    assert not first.cache_hit and second.cache_hit
    assert first.train.to_dict() == second.train.to_dict() and first.eval.to_dict() == second.eval.to_dict()
    assert second.stats == first.stats and first.stats.train.pairs
    assert list(second.train.column_names) == list(PREFERENCE_COLUMNS)
    assert first.stats.sources[0].rows_read == 40 and first.stats.sources[0].rows_kept == 40
    assert first.stats.train.rows + first.stats.eval.rows == 40
    for pair in first.train:
        assert pair["chosen_ids"] != pair["rejected_ids"] and pair["chosen_ids"][-1] == tokenizer.eos_token_id


def config_file(tmp_path: Path, data: Path, extra: str = "") -> Path:
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(
        f"model: {{preset: tiny-llama}}\n"
        f"data:\n  sequence_len: 64\n  dataset_prepared_path: {tmp_path / 'cache'}\n"
        f"  datasets:\n    - {{path: {data}, type: preference}}\n{extra}"
        f"training: {{output_dir: {tmp_path / 'out'}}}\n"
    )
    return cfg


def test_preprocess_shows_pair_counts_and_lengths(tmp_path, capsys):
    assert main(["preprocess", str(config_file(tmp_path, SAMPLE)), "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert "data: 40 train pairs, no eval split" in out
    assert "prompt mean" in out and "chosen mean" in out and "rejected mean" in out
    assert "tokens with its prompt shared (training.preference.share_prompt)" in out and "fewer)" in out
    assert "--- pair 0: prompt" in out and "  chosen (" in out and "  rejected (" in out


def test_validate_and_train_refuse_pairs_without_a_preference_objective(tmp_path, capsys):
    cfg = config_file(tmp_path, SAMPLE)
    for command in ("validate", "train"):
        assert main([command, str(cfg)]) == 2
        err = capsys.readouterr().err
        assert "data.datasets.0.type: preference needs a preference objective" in err
    assert not (tmp_path / "out").exists()


def test_preference_and_sft_datasets_cannot_be_mixed(tmp_path):
    raw = {
        "model": {"preset": "tiny-llama"},
        "data": {
            "datasets": [{"path": "p.jsonl", "type": "preference"}, {"path": "c.jsonl", "type": "chat"}],
        },
    }
    with pytest.raises(ConfigError, match=r"data.datasets.0.type: preference cannot be mixed with SFT datasets"):
        parse_config(raw)
    raw["data"]["datasets"] = [{"path": "c.jsonl", "type": "chat"}]
    raw["data"]["test_datasets"] = [{"path": "p.jsonl", "type": "preference"}]
    with pytest.raises(ConfigError, match=r"data.datasets.0 \(chat\)"):
        parse_config(raw)


def test_text_pairs_need_no_chat_template_but_chat_pairs_do(tmp_path, write_jsonl, make_data_config, tokenizer):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    text = write_jsonl(tmp_path, [{"prompt": "q", "chosen": " a", "rejected": " b"}], name="text.jsonl")
    assert len(prepare(make_data_config, bare, text).train) == 1
    chat = write_jsonl(tmp_path, [{"prompt": [user("q")], "chosen": [assistant("a")], "rejected": [assistant("b")]}])
    with pytest.raises(DataError, match=r"row 1: a preference dataset with chat messages needs a chat template"):
        prepare(make_data_config, bare, chat, on_bad_row="skip")  # the template, not the row: never skipped
