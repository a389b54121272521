"""``hone preprocess --show N``: rows decoded as the model sees them, trained spans marked."""

from __future__ import annotations

import yaml

from hone.cli import main
from hone.data.prepare import prepare_data
from hone.data.show import GREEN, RESET, render_row, render_rows, trained_pieces

CHAT = {
    "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "See you"},
    ]
}
EXPECTED = (
    "<|begin_of_text|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n[[Hello<|im_end|>]]\n"
    "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n[[See you<|im_end|>]]\n"
)


def test_pieces_follow_the_labels():
    assert trained_pieces([1, 2, 3, 4, 5], [-100, 2, 3, -100, 5]) == [([1], False), ([2, 3], True), ([4], False), ([5], True)]


def test_a_chat_row_shows_its_template_and_exactly_its_trained_replies(tmp_path, write_jsonl, make_data_config, tokenizer):
    path = write_jsonl(tmp_path, [CHAT])
    prepared = prepare_data(make_data_config([{"path": path, "type": "chat"}], sequence_len=128), tokenizer)
    row = prepared.train[0]
    assert render_row(row["input_ids"], row["labels"], tokenizer, color=False) == EXPECTED
    coloured = render_row(row["input_ids"], row["labels"], tokenizer, color=True)
    assert coloured == EXPECTED.replace("[[", GREEN).replace("]]", RESET)
    text = render_rows(prepared.train, tokenizer, 5, color=False)
    trained = sum(label != -100 for label in row["labels"])
    assert text.splitlines()[0] == "the first 1 of 1 training rows as the model sees them; trained tokens between [[ and ]]:"
    assert f"--- row 0: {len(row['input_ids'])} tokens, {trained} trained" in text


def test_preprocess_show_prints_marked_rows(tmp_path, write_jsonl, capsys):
    rows = [{"instruction": f"Say {i}", "output": f"number {i}"} for i in range(4)]
    data = write_jsonl(tmp_path, rows)
    cfg = tmp_path / "cfg.yml"
    raw = {
        "model": {"preset": "tiny-llama"},
        "data": {"datasets": [{"path": str(data), "type": "alpaca"}], "dataset_prepared_path": str(tmp_path / "prep")},
    }
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["preprocess", str(cfg), "--show", "2"]) == 0
    out = capsys.readouterr().out
    assert "the first 2 of 4 training rows" in out and out.count("--- row ") == 2
    assert "### Response:\n[[number " in out and "<|im_end|>]]" in out  # the answer and its EOS are trained
    assert "\x1b[" not in out  # not a terminal: brackets, no colour codes
