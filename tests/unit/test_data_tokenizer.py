"""The bundled tokenizer, ``load_tokenizer``, and the bundled sample datasets."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from hone.config.model import ModelConfig
from hone.errors import HoneError
from hone.models.tokenizer import bundled_tokenizer_path, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "examples" / "data"


def _import_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- bundled tokenizer


def test_bundled_tokenizer_is_small_and_has_distinct_special_tokens(tokenizer):
    files = list(bundled_tokenizer_path().iterdir())
    assert {"tokenizer.json", "tokenizer_config.json"} <= {f.name for f in files}
    assert sum(f.stat().st_size for f in files) < 300_000
    assert len(tokenizer) == 2048 and tokenizer.is_fast
    ids = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert None not in ids and len(ids) == 3
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|begin_of_text|>", "<|im_end|>", "<|pad|>")


def test_bundled_tokenizer_round_trips_any_text_and_adds_bos(tokenizer):
    text = "Grüße, 世界! tab\tnew\nline 🎉 \x00 what color is a lemon?"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]) == text
    assert tokenizer.unk_token_id is None  # byte-level: nothing is unknown


def test_bundled_chat_template_is_chatml_with_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3 and ids.count(tokenizer.eos_token_id) == 3


def test_build_script_is_deterministic_and_matches_the_committed_files(tmp_path):
    build = _import_script(REPO / "scripts" / "build_tokenizer.py")
    build.build(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "tok" / name).read_bytes() == (bundled_tokenizer_path() / name).read_bytes(), name


# ---------------------------------------------------------------- load_tokenizer


def test_load_tokenizer_prefers_tokenizer_path_then_model_path(tmp_path):
    tok_dir = tmp_path / "tok"
    shutil.copytree(bundled_tokenizer_path(), tok_dir)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["model_max_length"] = 777
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    assert load_tokenizer(ModelConfig(path=model_dir, tokenizer_path=tok_dir)).model_max_length == 777
    shutil.copytree(tok_dir, model_dir, dirs_exist_ok=True)
    assert load_tokenizer(ModelConfig(path=model_dir)).model_max_length == 777
    assert load_tokenizer(ModelConfig(preset="tiny-qwen3")).model_max_length == 1 << 20


def test_missing_tokenizer_directory_names_path_and_key(tmp_path):
    with pytest.raises(HoneError, match=r"tokenizer directory not found: '.*nowhere' \(model.tokenizer_path"):
        load_tokenizer(ModelConfig(preset="tiny-llama", tokenizer_path=tmp_path / "nowhere"))
    with pytest.raises(HoneError, match=r"tokenizer directory not found: '.*gone' \(model.path"):
        load_tokenizer(ModelConfig(path=tmp_path / "gone"))


@pytest.mark.parametrize("damage", ["empty", "garbage"])
def test_invalid_tokenizer_directory_names_the_path(tmp_path, damage):
    tok_dir = tmp_path / "tok"
    if damage == "empty":
        tok_dir.mkdir()
    else:
        shutil.copytree(bundled_tokenizer_path(), tok_dir)
        (tok_dir / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    with pytest.raises(HoneError, match=rf"cannot load a tokenizer from '{tok_dir}' \(model.tokenizer_path\)"):
        load_tokenizer(ModelConfig(preset="tiny-llama", tokenizer_path=tok_dir))


def test_pad_falls_back_to_eos_only_when_missing(tmp_path):
    tok_dir = tmp_path / "tok"
    shutil.copytree(bundled_tokenizer_path(), tok_dir)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del config["pad_token"]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(ModelConfig(preset="tiny-llama", tokenizer_path=tok_dir))
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert load_tokenizer(ModelConfig(preset="tiny-llama")).pad_token == "<|pad|>"


# ---------------------------------------------------------------- sample data


def test_sample_data_generator_is_deterministic_and_matches_the_committed_files(tmp_path):
    make = _import_script(SAMPLES / "make_sample_data.py")
    make.main(tmp_path)
    for name in ("chat_sample.jsonl", "alpaca_sample.jsonl", "completion_sample.jsonl", "preference_sample.jsonl"):
        committed = (SAMPLES / name).read_bytes()
        assert (tmp_path / name).read_bytes() == committed, name
        assert len(committed) < 1_000_000


def test_sample_data_rows_are_short_and_varied(make_data_config, tokenizer):
    from hone.data.prepare import prepare_data

    datasets = [
        {"path": SAMPLES / "chat_sample.jsonl", "type": "chat"},
        {"path": SAMPLES / "alpaca_sample.jsonl", "type": "alpaca"},
        {"path": SAMPLES / "completion_sample.jsonl", "type": "completion"},
    ]
    prepared = prepare_data(make_data_config(datasets, sequence_len=64), tokenizer)
    rows = [s.rows_read for s in prepared.stats.sources]
    assert rows[0] >= 1900 and rows[1] >= 1900 and rows[2] >= 100
    assert all(s.rows_kept == s.rows_read for s in prepared.stats.sources)  # every row < 64 tokens
    chats = [json.loads(line) for line in (SAMPLES / "chat_sample.jsonl").read_text().splitlines()]
    roles = {m["role"] for chat in chats for m in chat["messages"]}
    assert roles == {"system", "user", "assistant"}
    assert any(len(chat["messages"]) >= 4 for chat in chats)  # multi-turn
    assert "What color is a lemon?" in {m["content"] for chat in chats for m in chat["messages"]}
