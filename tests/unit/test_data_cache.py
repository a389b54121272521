"""The prepared-data cache: what changes the key, hits, atomicity, stats and the summary."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hone.data import cache as cache_module
from hone.data import prepare as prepare_module
from hone.data.cache import FileHasher, cache_root, key_inputs, key_of
from hone.data.errors import DataError
from hone.data.prepare import prepare_data
from hone.data.stats import DataStats
from hone.data.summary import render_summary


def chat_rows(rng: random.Random, n: int) -> list[dict]:
    words = ["lemon", "yellow", "Veloria", "river", "capital", "sorumi"]
    return [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(1, 6))) + "?"},
                {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 4)))},
            ]
        }
        for _ in range(n)
    ]


@pytest.fixture
def dataset(tmp_path, write_jsonl):
    return write_jsonl(tmp_path / "data", chat_rows(random.Random(20), 40), name="chat.jsonl")


def key(cfg, tokenizer) -> str:
    return key_of(key_inputs(cfg, tokenizer, FileHasher(None)))


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


def test_second_run_hits_the_cache_with_identical_data_and_stats(dataset, make_data_config, tokenizer):
    cfg = make_data_config([{"path": dataset, "type": "chat"}], val_set_size=0.2)
    first = prepare_data(cfg, tokenizer)
    second = prepare_data(cfg, tokenizer)
    assert not first.cache_hit and second.cache_hit
    assert second.cache_dir == first.cache_dir and second.cache_dir.parent == cfg.data.dataset_prepared_path
    assert first.train.to_dict() == second.train.to_dict() and first.eval.to_dict() == second.eval.to_dict()
    assert second.stats == first.stats
    assert DataStats.from_json((second.cache_dir / "stats.json").read_text()) == first.stats
    assert sorted(p.name for p in first.cache_dir.iterdir()) == ["eval", "key.json", "stats.json", "train"]


def test_key_changes_with_file_content_even_at_equal_size_and_instantly(dataset, make_data_config, tokenizer):
    cfg = make_data_config([{"path": dataset, "type": "chat"}])
    first = prepare_data(cfg, tokenizer)
    text = dataset.read_text()
    swapped = text.replace("lemon", "LEMON", 1)
    assert len(swapped) == len(text) and swapped != text
    stat = dataset.stat()
    dataset.write_text(swapped)
    os.utime(dataset, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime
    second = prepare_data(cfg, tokenizer)
    assert not second.cache_hit and second.cache_dir != first.cache_dir


def test_memoised_hash_is_used_only_for_files_older_than_the_hash(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text("aaaa")
    index = tmp_path / "index.json"
    hasher = FileHasher(index)
    old = hasher.sha256(path)
    hasher.save()
    # A racy entry (file modified within the timestamp granularity of hashing) is re-hashed.
    stat = path.stat()
    path.write_text("bbbb")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert FileHasher(index).sha256(path) != old
    # An old file with a settled memo: the memo is trusted (proved by a planted fake digest).
    ancient = 1_000_000_000_000_000_000
    os.utime(path, ns=(ancient, ancient))
    hasher = FileHasher(index)
    real = hasher.sha256(path)
    hasher.save()
    memo = json.loads(index.read_text())
    memo[str(path.resolve())]["sha256"] = "planted"
    index.write_text(json.dumps(memo))
    assert FileHasher(index).sha256(path) == "planted"
    assert real == cache_module.sha256_file(path)


@pytest.mark.parametrize(
    ("change", "changes_key"),
    [
        ({"sequence_len": 1024}, True),
        ({"excess_length_strategy": "truncate"}, True),
        ({"on_bad_row": "skip"}, True),
        ({"val_set_size": 0.1}, True),
        ({"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}, True),
        ({"dataset": {"train_on": ["user", "assistant"]}}, True),
        ({"dataset": {"weight": 2.0}}, True),
        ({"dataset": {"role_map": {"human": "user"}}}, True),
        ({"seed": 1}, True),
        ({"num_proc": 2}, False),
        ({"dataset_prepared_path": "elsewhere"}, False),
        ({"dataset": {"file_format": "jsonl"}}, False),  # same as auto for a .jsonl file
    ],
)
def test_key_depends_on_exactly_the_options_that_change_the_output(
    dataset, make_data_config, tokenizer, tmp_path, change, changes_key
):
    base = make_data_config([{"path": dataset, "type": "chat"}], sequence_len=512)
    entry = {"path": dataset, "type": "chat", **change.pop("dataset", {})}
    options = {"sequence_len": 512, **change}
    seed = options.pop("seed", 42)
    if "dataset_prepared_path" in options:
        options["dataset_prepared_path"] = str(tmp_path / options["dataset_prepared_path"])
    other = make_data_config([entry], seed=seed, **options)
    assert (key(base, tokenizer) != key(other, tokenizer)) == changes_key


def test_key_ignores_where_the_file_is_and_its_mtime(dataset, make_data_config, tokenizer, tmp_path):
    moved = tmp_path / "moved" / "renamed.jsonl"
    moved.parent.mkdir()
    shutil.copy(dataset, moved)
    os.utime(moved, ns=(1, 1))
    a = make_data_config([{"path": dataset, "type": "chat"}])
    b = make_data_config([{"path": moved, "type": "chat"}])
    assert key(a, tokenizer) == key(b, tokenizer)
    prepare_data(a, tokenizer)
    hit = prepare_data(b, tokenizer)
    assert hit.cache_hit and hit.stats.sources[0].path == str(moved)  # shows the current path


def test_key_changes_with_the_tokenizer(dataset, make_data_config, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from hone.models.tokenizer import bundled_tokenizer_path

    cfg = make_data_config([{"path": dataset, "type": "chat"}])
    reference = key(cfg, tokenizer)
    same = AutoTokenizer.from_pretrained(str(bundled_tokenizer_path()), local_files_only=True)
    assert key(cfg, same) == reference

    other_template = AutoTokenizer.from_pretrained(str(bundled_tokenizer_path()), local_files_only=True)
    other_template.chat_template = other_template.chat_template.replace("'\\n'", "'\\n\\n'", 1)
    assert key(cfg, other_template) != reference

    copy = tmp_path / "tok"
    shutil.copytree(bundled_tokenizer_path(), copy)
    data = json.loads((copy / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same size, different ids
    (copy / "tokenizer.json").write_text(json.dumps(data))
    assert key(cfg, AutoTokenizer.from_pretrained(str(copy), local_files_only=True)) != reference


def test_failure_mid_preprocessing_leaves_no_entry(dataset, make_data_config, tokenizer, tmp_path, write_jsonl, monkeypatch):
    bad = write_jsonl(tmp_path, [{"messages": [{"role": "user", "content": "q"}]}, {"messages": 3}], name="bad.jsonl")
    cfg = make_data_config([{"path": dataset, "type": "chat"}, {"path": bad, "type": "chat"}])
    root = cfg.data.dataset_prepared_path
    with pytest.raises(DataError, match=r"bad.jsonl row 2"):
        prepare_data(cfg, tokenizer)
    assert entries(root) == []

    # A crash after the train split is written on disk, before the entry is complete.
    cfg = make_data_config([{"path": dataset, "type": "chat"}], val_set_size=0.2)
    real = prepare_module._write_split
    calls = []

    def write_then_crash(*args, **kwargs):
        calls.append(args[4])
        result = real(*args, **kwargs)
        if len(calls) == 2:
            assert (args[4]).is_dir()  # eval was written, the entry was not yet published
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(prepare_module, "_write_split", write_then_crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, tokenizer)
    assert entries(root) == []
    monkeypatch.setattr(prepare_module, "_write_split", real)
    assert not prepare_data(cfg, tokenizer).cache_hit
    assert prepare_data(cfg, tokenizer).cache_hit


def test_staging_left_by_a_killed_process_is_removed(dataset, make_data_config, tokenizer):
    cfg = make_data_config([{"path": dataset, "type": "chat"}])
    root = Path(cfg.data.dataset_prepared_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    stale = root / ".tmp-0123456789ab-dead"
    (stale / "train").mkdir(parents=True)
    (stale / "owner.json").write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    alive = root / ".tmp-0123456789ab-alive"
    alive.mkdir()
    (alive / "owner.json").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    prepare_data(cfg, tokenizer)
    assert not stale.exists() and alive.exists()


def test_a_damaged_entry_is_rebuilt(dataset, make_data_config, tokenizer):
    cfg = make_data_config([{"path": dataset, "type": "chat"}])
    first = prepare_data(cfg, tokenizer)
    rows = first.train.to_dict()
    for arrow in (first.cache_dir / "train").glob("*.arrow"):
        arrow.write_bytes(b"garbage")
    del first
    rebuilt = prepare_data(cfg, tokenizer)
    assert not rebuilt.cache_hit and rebuilt.train.to_dict() == rows
    assert prepare_data(cfg, tokenizer).cache_hit


def test_no_cache_writes_nothing_under_the_root(dataset, make_data_config, tokenizer):
    cfg = make_data_config([{"path": dataset, "type": "chat"}])
    prepared = prepare_data(cfg, tokenizer, use_cache=False)
    assert len(prepared.train) == 40 and not prepared.cache_enabled and not prepared.cache_hit
    root = Path(cfg.data.dataset_prepared_path)
    assert not root.exists() or list(root.iterdir()) == []
    assert "cache: not used" in render_summary(prepared)


def test_cache_root_precedence(make_data_config, dataset, monkeypatch, tmp_path):
    cfg = make_data_config([{"path": dataset, "type": "chat"}], dataset_prepared_path=str(tmp_path / "explicit"))
    assert cache_root(cfg.data) == tmp_path / "explicit"
    cfg = make_data_config([{"path": dataset, "type": "chat"}], dataset_prepared_path=None)
    monkeypatch.setenv("HONE_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root(cfg.data) == tmp_path / "env" / "datasets"
    monkeypatch.delenv("HONE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root(cfg.data) == tmp_path / "home" / ".cache" / "hone" / "datasets"


def test_unwritable_cache_root_is_a_clear_error(dataset, make_data_config, tokenizer, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = make_data_config([{"path": dataset, "type": "chat"}], dataset_prepared_path=str(blocker / "cache"))
    with pytest.raises(DataError, match=r"cannot write the prepared-data cache under '.*file/cache'"):
        prepare_data(cfg, tokenizer)


def test_many_rows_hit_the_cache(tmp_path, write_jsonl, make_data_config, tokenizer):
    rng = random.Random(21)
    path = write_jsonl(tmp_path, chat_rows(rng, 10_000), name="big.jsonl")
    cfg = make_data_config([{"path": path, "type": "chat"}], num_proc=2)
    first = prepare_data(cfg, tokenizer)
    second = prepare_data(cfg, tokenizer)
    assert second.cache_hit and len(second.train) == 10_000 == first.stats.train.rows
    assert second.train[1234] == first.train[1234]


def test_summary_reports_counts_histogram_and_cache(tmp_path, write_jsonl, make_data_config, tokenizer):
    rows = chat_rows(random.Random(22), 30) + [{"messages": "oops"}]
    path = write_jsonl(tmp_path, rows)
    cfg = make_data_config([{"path": path, "type": "chat"}], on_bad_row="skip", val_set_size=0.2)
    first = prepare_data(cfg, tokenizer)
    text = render_summary(first)
    stats = first.stats
    assert f"data: {stats.train.rows} train rows, {stats.eval.rows} eval rows" in text
    assert f"{stats.train.tokens:,}" in text and f"{stats.train.trained_tokens:,}" in text
    assert "skipped: 1 bad rows" in text and f"{path} row 31: field 'messages' is a string ('oops')" in text
    assert sum(b.count for b in stats.train.histogram) == stats.train.rows
    assert f"{stats.train.histogram[0].lo}-{stats.train.histogram[0].hi} | #" in text
    assert text.endswith(f"cache: {first.cache_dir} (written)")
    assert render_summary(prepare_data(cfg, tokenizer)).endswith(f"cache: {first.cache_dir} (hit)")


def test_a_published_entry_is_readable_by_the_users_a_umask_allows(dataset, make_data_config, tokenizer):
    """mkdtemp stages 0700; the published entry gets mkdir's mode under the umask (0755 for 022)."""
    import stat

    cfg = make_data_config([{"path": dataset, "type": "chat"}])
    previous = os.umask(0o022)
    try:
        prepared = prepare_data(cfg, tokenizer)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(prepared.cache_dir.stat().st_mode) == 0o755
