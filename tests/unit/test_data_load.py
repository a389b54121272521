"""Loading local files: every format, and every bad input raising DataError with file and row."""

from __future__ import annotations

import json
import random

import pandas as pd
import pyarrow as pa
import pytest

from hone.data.errors import DataError
from hone.data.prepare import prepare_data


def alpaca_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "instruction": f"q{i} " + " ".join(rng.choices(["red", "Veloria", "river", "naïve"], k=rng.randint(1, 5))),
            "input": "",
            "output": f"a{i}",
        }
        for i in range(n)
    ]


def encoded_rows(prepared) -> list[tuple]:
    return sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in prepared.train)


@pytest.mark.parametrize("file_format", ["json", "parquet", "csv", "arrow"])
def test_every_file_format_gives_the_same_rows_as_jsonl(tmp_path, write_jsonl, make_data_config, tokenizer, file_format):
    rows = alpaca_rows(30, seed=5)
    reference = prepare_data(make_data_config([{"path": write_jsonl(tmp_path, rows), "type": "alpaca"}]), tokenizer)
    path = tmp_path / f"data.{file_format}"
    frame = pd.DataFrame(rows)
    if file_format == "json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    elif file_format == "parquet":
        frame.to_parquet(path)
    elif file_format == "csv":
        frame.to_csv(path, index=False)
    else:
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    prepared = prepare_data(make_data_config([{"path": path, "type": "alpaca"}]), tokenizer)
    assert encoded_rows(prepared) == encoded_rows(reference)


def test_explicit_file_format_overrides_the_suffix(tmp_path, write_jsonl, make_data_config, tokenizer):
    path = write_jsonl(tmp_path, alpaca_rows(5, seed=1), name="data.txt")
    prepared = prepare_data(make_data_config([{"path": path, "type": "alpaca", "file_format": "jsonl"}]), tokenizer)
    assert len(prepared.train) == 5


def test_missing_file(tmp_path, make_data_config, tokenizer):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=r"data file not found: '.*nope.jsonl' \(data.datasets\[0\].path"):
        prepare_data(make_data_config([{"path": path, "type": "alpaca"}]), tokenizer)


def test_missing_test_dataset_names_its_key(tmp_path, write_jsonl, make_data_config, tokenizer):
    good = write_jsonl(tmp_path, alpaca_rows(3, seed=1))
    cfg = make_data_config(
        [{"path": good, "type": "alpaca"}], test_datasets=[{"path": tmp_path / "eval.jsonl", "type": "alpaca"}]
    )
    with pytest.raises(DataError, match=r"data.test_datasets\[0\].path"):
        prepare_data(cfg, tokenizer)


def test_malformed_jsonl_names_the_line(tmp_path, write_jsonl, make_data_config, tokenizer):
    rows = [json.dumps(r) for r in alpaca_rows(6, seed=2)]
    rows.insert(4, '{"instruction": "x", "output": "y"')  # line 5: unterminated object
    path = write_jsonl(tmp_path, rows)
    with pytest.raises(DataError) as info:
        prepare_data(make_data_config([{"path": path, "type": "alpaca"}]), tokenizer)
    assert f"{path} line 5 (" in str(info.value) and "malformed JSON Lines" in str(info.value)


def test_malformed_json_names_line_and_column(tmp_path, make_data_config, tokenizer):
    path = tmp_path / "data.json"
    path.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c" "output": "d"}\n]\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"data.json line 3 column \d+ .*malformed JSON file"):
        prepare_data(make_data_config([{"path": path, "type": "alpaca"}]), tokenizer)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, make_data_config, tokenizer, content):
    path = tmp_path / "data.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=r"data.jsonl: the file (is empty|has no rows) \(data.datasets\[0\]\)"):
        prepare_data(make_data_config([{"path": path, "type": "alpaca"}]), tokenizer)


def test_csv_with_only_a_header_has_no_rows(tmp_path, make_data_config, tokenizer):
    path = tmp_path / "data.csv"
    path.write_text("instruction,output\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"data.csv: the file has no rows"):
        prepare_data(make_data_config([{"path": path, "type": "alpaca"}]), tokenizer)


def test_unreadable_file_names_it_and_the_format(tmp_path, make_data_config, tokenizer):
    path = tmp_path / "data.parquet"
    path.write_bytes(b"this is not parquet at all")
    with pytest.raises(DataError, match=r"data.parquet: cannot read it as parquet \(data.datasets\[0\]\)"):
        prepare_data(make_data_config([{"path": path, "type": "alpaca"}]), tokenizer)


def test_column_absent_from_the_whole_file_names_the_config_key(tmp_path, write_jsonl, make_data_config, tokenizer):
    path = write_jsonl(tmp_path, [{"instruction": "a", "answer": "b"}])
    with pytest.raises(DataError) as info:
        prepare_data(make_data_config([{"path": path, "type": "alpaca"}]), tokenizer)
    message = str(info.value)
    assert "no column 'output' (data.datasets[0].field_output = 'output')" in message
    assert "columns are: instruction, answer" in message


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ({"instruction": "x"}, "field 'output' is missing or null (expected a string)"),
        ({"instruction": "x", "output": None}, "field 'output' is missing or null (expected a string)"),
        ({"instruction": "x", "output": 7}, "field 'output' is a number (7) (expected a string)"),
        ({"instruction": ["x"], "output": "y"}, "field 'instruction' is a list of 1 item (expected a string)"),
        (
            {"instruction": "x", "input": {"a": 1}, "output": "y"},
            "field 'input' is an object with keys ['a'] (expected a string)",
        ),
    ],
)
def test_bad_row_errors_with_row_number_or_is_skipped_and_counted(
    tmp_path, write_jsonl, make_data_config, tokenizer, bad, expected
):
    rows = alpaca_rows(12, seed=3)
    bad_positions = [2, 7, 11]  # 0-based
    for position in bad_positions:
        rows[position] = bad
    path = write_jsonl(tmp_path, rows)
    with pytest.raises(DataError) as info:
        prepare_data(make_data_config([{"path": path, "type": "alpaca"}]), tokenizer)
    message = str(info.value)
    assert f"{path} row 3: {expected}" in message
    assert "data.on_bad_row: skip" in message

    prepared = prepare_data(make_data_config([{"path": path, "type": "alpaca"}], on_bad_row="skip"), tokenizer)
    source = prepared.stats.sources[0]
    assert len(prepared.train) == 12 - len(bad_positions) == source.rows_kept
    assert source.bad_rows_skipped == len(bad_positions) == prepared.stats.train.bad_rows_skipped
    assert source.skipped_examples == [f"{path} row {p + 1}: {expected}" for p in bad_positions]


def test_every_row_bad_under_skip_is_an_error_that_says_why(tmp_path, write_jsonl, make_data_config, tokenizer):
    path = write_jsonl(tmp_path, [{"instruction": "x", "output": i} for i in range(4)])
    with pytest.raises(DataError) as info:
        prepare_data(make_data_config([{"path": path, "type": "alpaca"}], on_bad_row="skip"), tokenizer)
    message = str(info.value)
    assert "no usable rows" in message and "4 rows read" in message and "4 bad rows skipped" in message
    assert "row 1: field 'output' is a number (0)" in message


def test_completion_empty_text_is_a_bad_row(tmp_path, write_jsonl, make_data_config, tokenizer):
    path = write_jsonl(tmp_path, [{"text": "hello"}, {"text": ""}])
    with pytest.raises(DataError, match=r"row 2: field 'text' is an empty string"):
        prepare_data(make_data_config([{"path": path, "type": "completion"}]), tokenizer)


def test_loading_writes_nothing_outside_the_cache_root(tmp_path, write_jsonl, make_data_config, tokenizer):
    import datasets

    def snapshot(root):
        return sorted(str(p) for p in root.rglob("*")) if root.exists() else []

    hf_cache = datasets.config.HF_DATASETS_CACHE
    before = snapshot(hf_cache)
    path = write_jsonl(tmp_path / "data", alpaca_rows(5, seed=4))
    cfg = make_data_config([{"path": path, "type": "alpaca"}], dataset_prepared_path=str(tmp_path / "cache"))
    prepare_data(cfg, tokenizer)
    assert snapshot(hf_cache) == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["data.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "data"]


def test_file_names_with_glob_characters_are_literal(tmp_path, write_jsonl, make_data_config, tokenizer):
    write_jsonl(tmp_path, alpaca_rows(3, seed=6), name="data1.jsonl")  # would match the pattern
    path = write_jsonl(tmp_path, alpaca_rows(5, seed=6), name="data[1]*.jsonl")
    prepared = prepare_data(make_data_config([{"path": path, "type": "alpaca"}]), tokenizer)
    assert len(prepared.train) == 5
