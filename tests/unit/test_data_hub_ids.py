"""Bare hub dataset ids (``path: tatsu-lab/alpaca``) read from the local caches: the hub
snapshot layout (split files, sharded parquet) and ``datasets``' Arrow cache; a clear error
with the download command when the id is in neither; ``hone validate`` recognises the id."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from hone.cli import main
from hone.config import parse_config
from hone.data.errors import DataError
from hone.data.hub_files import with_cached_data_files
from hone.data.prepare import prepare_data

COMMIT = "c0ffee" + "0" * 34


def alpaca_rows(prefix: str, n: int) -> list[dict]:
    return [{"instruction": f"{prefix} question {i}", "input": "", "output": f"{prefix} answer {i}"} for i in range(n)]


def snapshot(cache: Path, repo_id: str) -> Path:
    """An empty snapshot of dataset ``repo_id`` at ref main, laid out as huggingface_hub writes it."""
    repo = cache / f"datasets--{repo_id.replace('/', '--')}"
    folder = repo / "snapshots" / COMMIT
    folder.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return folder


def write_blob(folder: Path, relative: str, write) -> None:
    """A snapshot file as a symlink into ``blobs/``, as in a real cache."""
    blobs = folder.parents[1] / "blobs"
    blobs.mkdir(exist_ok=True)
    blob = blobs / f"blob{len(list(blobs.iterdir()))}"
    write(blob)
    target = folder / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(blob)


def parquet_writer(rows: list[dict]):
    return lambda path: pq.write_table(pa.Table.from_pylist(rows), str(path))


def jsonl_writer(rows: list[dict]):
    return lambda path: path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def caches(tmp_path, monkeypatch):
    hub, arrow = tmp_path / "hub", tmp_path / "hf_datasets"
    hub.mkdir()
    arrow.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(arrow))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local directory named like an id
    return hub, arrow


def config(tmp_path: Path, path: str, **entry) -> object:
    return parse_config(
        {
            "model": {"preset": "tiny-llama"},
            "data": {
                "datasets": [{"path": path, "type": "alpaca", **entry}],
                "sequence_len": 64,
                "dataset_prepared_path": str(tmp_path / "prep"),
            },
        }
    )


def trained_outputs(prepared, tokenizer) -> set[str]:
    return {tokenizer.decode(row["input_ids"]).split("### Response:\n")[1].split("<")[0] for row in prepared.train}


def test_sharded_parquet_snapshot_reads_the_train_split(caches, tmp_path, tokenizer):
    folder = snapshot(caches[0], "tatsu-lab/alpaca")
    write_blob(folder, "data/train-00000-of-00002.parquet", parquet_writer(alpaca_rows("a", 3)))
    write_blob(folder, "data/train-00001-of-00002.parquet", parquet_writer(alpaca_rows("b", 2)))
    write_blob(folder, "data/test-00000-of-00001.parquet", parquet_writer(alpaca_rows("t", 4)))
    write_blob(folder, "README.md", lambda p: p.write_text("# card"))
    prepared = prepare_data(config(tmp_path, "tatsu-lab/alpaca"), tokenizer)
    assert trained_outputs(prepared, tokenizer) == {f"a answer {i}" for i in range(3)} | {"b answer 0", "b answer 1"}
    assert prepared.stats.sources[0].path == "tatsu-lab/alpaca"
    test_split = prepare_data(config(tmp_path, "tatsu-lab/alpaca", split="test"), tokenizer)
    assert trained_outputs(test_split, tokenizer) == {f"t answer {i}" for i in range(4)}


def test_single_file_snapshot_without_split_names_is_the_train_split(caches, tmp_path, tokenizer):
    folder = snapshot(caches[0], "yahma/alpaca-cleaned")
    write_blob(folder, "alpaca_data_cleaned.jsonl", jsonl_writer(alpaca_rows("c", 3)))
    write_blob(folder, ".gitattributes", lambda p: p.write_text("*.json filter=lfs"))
    cfg = with_cached_data_files(config(tmp_path, "yahma/alpaca-cleaned"))
    assert cfg.data.datasets[0].resolved_format == "jsonl" and len(cfg.data.datasets[0].files) == 1
    assert trained_outputs(prepare_data(config(tmp_path, "yahma/alpaca-cleaned"), tokenizer), tokenizer) == {
        f"c answer {i}" for i in range(3)
    }


def test_datasets_arrow_cache_is_read_when_there_is_no_snapshot(caches, tmp_path, tokenizer):
    folder = caches[1] / "Org___chats" / "default" / "0.0.0" / "abc123"
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(alpaca_rows("r", 3))
    with pa.OSFile(str(folder / "chats-train.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)  # datasets' cache files are Arrow streams
    prepared = prepare_data(config(tmp_path, "Org/chats"), tokenizer)
    assert trained_outputs(prepared, tokenizer) == {f"r answer {i}" for i in range(3)}
    with pytest.raises(DataError, match=r"no split 'validation' \(its splits: train\)"):
        prepare_data(config(tmp_path, "Org/chats", split="validation"), tokenizer)


def test_a_missing_split_lists_the_splits_there_are(caches, tmp_path, tokenizer):
    folder = snapshot(caches[0], "Org/ultra")
    write_blob(folder, "data/train_sft-00000-of-00001.parquet", parquet_writer(alpaca_rows("s", 2)))
    with pytest.raises(DataError, match=r"data.datasets\[0\].path: 'Org/ultra' .* no split 'train' \(its splits: train_sft\)"):
        prepare_data(config(tmp_path, "Org/ultra"), tokenizer)
    assert len(prepare_data(config(tmp_path, "Org/ultra", split="train_sft"), tokenizer).train) == 2


def test_an_absent_id_names_key_value_and_the_download_command(caches, tmp_path, tokenizer):
    with pytest.raises(DataError) as info:
        prepare_data(config(tmp_path, "tatsu-lab/alpaca"), tokenizer)
    message = str(info.value)
    assert message.startswith("data.datasets[0].path: 'tatsu-lab/alpaca'")
    assert "huggingface-cli download --repo-type dataset tatsu-lab/alpaca" in message and "hf download" in message
    assert str(caches[0]) in message and str(caches[1]) in message


def validate(tmp_path: Path, path: str, capsys) -> tuple[int, str]:
    cfg = tmp_path / "cfg.yml"
    raw = {
        "model": {"preset": "tiny-llama"},
        "data": {"datasets": [{"path": path, "type": "alpaca"}]},
        "training": {"output_dir": str(tmp_path / "run")},
    }
    cfg.write_text(yaml.safe_dump(raw))
    rc = main(["validate", str(cfg)])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_validate_recognises_a_cached_id_and_explains_an_absent_one(caches, tmp_path, capsys):
    folder = snapshot(caches[0], "tatsu-lab/alpaca")
    write_blob(folder, "data/train-00000-of-00001.parquet", parquet_writer(alpaca_rows("a", 2)))
    rc, text = validate(tmp_path, "tatsu-lab/alpaca", capsys)
    assert rc == 0, text
    rc, text = validate(tmp_path, "Org/absent", capsys)
    assert rc == 2
    assert "cannot tell the file format" not in text and "file_format" not in text
    assert "data.datasets[0].path" in text and "'Org/absent'" in text and "--repo-type dataset Org/absent" in text


def test_split_is_only_for_ids():
    with pytest.raises(Exception, match="split: 'test' applies to hub dataset ids"):
        parse_config(
            {"model": {"preset": "tiny-llama"}, "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca", "split": "test"}]}}
        )


def test_a_local_file_named_like_an_id_needs_its_format(caches, tmp_path, tokenizer, capsys):
    local = tmp_path / "corpus" / "train"
    local.parent.mkdir()
    local.write_text(json.dumps(alpaca_rows("l", 1)[0]) + "\n")
    rc, text = validate(tmp_path, "corpus/train", capsys)
    assert rc == 2 and "cannot tell the file format of 'corpus/train'" in text and "file_format" in text
    assert len(prepare_data(config(tmp_path, "corpus/train", file_format="jsonl"), tokenizer).train) == 1
