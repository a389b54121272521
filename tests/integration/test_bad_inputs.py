"""Every bad input a new user falls into: exit 2, one paragraph on stderr, no traceback, and
nothing left behind that was not there before (issue 10).

Each test drives the CLI (``hone.cli.main``) on a tiny preset on the CPU and compares the
working directory before and after. ``capfd`` (not ``capsys``) so that log lines a library
writes to the real stderr are seen too.
"""

from __future__ import annotations

import errno
import json
import random
from pathlib import Path

import pytest
import yaml

import hone.paths
from hone.cli import main

WORDS = ["red", "green", "blue", "lemon", "lime", "fox", "dog", "quick", "lazy", "yellow"]


@pytest.fixture
def work(tmp_path) -> Path:
    """The user's directory: config, data and run directory live here; the cache does not."""
    path = tmp_path / "work"
    path.mkdir()
    return path


def write_rows(path: Path, n: int = 24) -> Path:
    rng = random.Random()
    path.write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))}) + "\n" for _ in range(n))
    )
    return path


def write_config(work: Path, *, model=None, data=None, training=None, name="cfg.yml") -> Path:
    dataset = data.pop("dataset", None) if data else None
    raw = {
        "model": model or {"preset": "tiny-llama", "dtype": "float32"},
        "data": {
            "datasets": [dataset or {"path": str(write_rows(work / "data.jsonl")), "type": "completion"}],
            "sequence_len": 64,
            "dataset_prepared_path": str(work.parent / "cache"),
            **(data or {}),
        },
        "adapter": {"type": "lora", "lora_r": 4},
        "training": {"max_steps": 2, "micro_batch_size": 2, "output_dir": str(work / "run"), **(training or {})},
        "logging": {"progress_bar": False},
    }
    path = work / name
    path.write_text(yaml.safe_dump(raw))
    return path


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def cli(argv: list[str], capfd) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capfd.readouterr()
    return code, out, err


def assert_one_paragraph(err: str, *fragments: str) -> str:
    """stderr holds exactly one ``error:`` paragraph (no traceback, no library log lines)."""
    text = err.strip()
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if not line.startswith("warning: ")]
    assert lines and lines[0].startswith("error: "), text
    assert len(lines) == 1 or all(line.startswith("  - ") for line in lines[1:]), text  # a config's list of problems
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    return text


def assert_failed_start(work: Path, before: dict, code: int, err: str, *fragments: str) -> str:
    assert code == 2, err
    text = assert_one_paragraph(err, *fragments)
    assert snapshot(work) == before, "a failed start left files behind or changed them"
    return text


def data_was_prepared(work: Path) -> bool:
    cache = work.parent / "cache"
    return cache.is_dir() and any(not p.name.startswith(".") for p in cache.iterdir() if p.is_dir())


# ---------------------------------------------------------------- the run directory


def test_output_dir_that_is_a_file_is_refused_before_the_data(work, capfd):
    cfg = write_config(work)
    (work / "run").write_text("not a directory")
    before = snapshot(work)
    for command in ("validate", "train"):
        code, _, err = cli([command, str(cfg)], capfd)
        assert_failed_start(work, before, code, err, "training.output_dir", "is a file")
    assert not data_was_prepared(work)


def test_output_dir_under_a_file_is_refused_before_the_data(work, capfd):
    (work / "afile").write_text("x")
    cfg = write_config(work, training={"output_dir": str(work / "afile" / "run")})
    before = snapshot(work)
    for command in ("validate", "train"):
        code, _, err = cli([command, str(cfg)], capfd)
        assert_failed_start(work, before, code, err, "training.output_dir", "afile", "which is a file")
    assert not data_was_prepared(work)


def test_unwritable_output_dir_is_refused_before_the_data(work, capfd, monkeypatch):
    """Root writes through chmod, so the probe write itself is made to fail (hone's name only)."""
    cfg = write_config(work, training={"output_dir": str(work / "deep" / "run")})
    before = snapshot(work)

    def read_only(path, mode="r", *args, **kwargs):
        if "w" in mode and hone.paths.PROBE_NAME in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(hone.paths, "open", read_only, raising=False)
    code, _, err = cli(["train", str(cfg)], capfd)
    assert_failed_start(work, before, code, err, "training.output_dir", "cannot write into", "Permission denied")
    assert not (work / "deep").exists()  # the directories the check created are gone again
    assert not data_was_prepared(work)


def test_a_full_disk_is_refused_before_the_data(work, capfd, monkeypatch):
    cfg = write_config(work)
    before = snapshot(work)
    monkeypatch.setattr(hone.paths, "MIN_FREE_BYTES", 1 << 62)
    for command in ("validate", "train"):
        code, _, err = cli([command, str(cfg)], capfd)
        assert_failed_start(work, before, code, err, "training.output_dir", "free", "needs at least")
    assert not data_was_prepared(work)


# ---------------------------------------------------------------- the model directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from hone.testing import save_tiny_model, tiny_tokenizer

    return save_tiny_model(
        tmp_path_factory.mktemp("models") / "llama", "tiny-llama", tiny_tokenizer(), seed=1, max_position_embeddings=128
    )


def copy_model(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_truncated_safetensors_is_caught_by_validate_and_before_data_prep(work, model_dir, capfd):
    model = copy_model(model_dir, work / "model")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cfg = write_config(work, model={"path": str(model), "dtype": "float32"})
    before = snapshot(work)
    for command in ("validate", "train"):
        code, _, err = cli([command, str(cfg)], capfd)
        assert_failed_start(work, before, code, err, "model.path", str(weights), "is truncated", "header describes")
    assert not data_was_prepared(work)


def test_corrupt_safetensors_header_is_caught(work, model_dir, capfd):
    model = copy_model(model_dir, work / "model")
    weights = model / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[8:20] = b"\x00garbage!!\xff\xfe"
    weights.write_bytes(bytes(raw))
    cfg = write_config(work, model={"path": str(model), "dtype": "float32"})
    code, _, err = cli(["validate", str(cfg)], capfd)
    assert code == 2
    assert_one_paragraph(err, str(weights), "corrupt")


def _edit_config(model: Path, **changes) -> None:
    raw = json.loads((model / "config.json").read_text())
    raw.update(changes)
    (model / "config.json").write_text(json.dumps(raw))


def _no_config(m: Path) -> None:
    (m / "config.json").unlink()


def _pickle_only(m: Path) -> None:
    (m / "model.safetensors").rename(m / "pytorch_model.bin")


def _no_weights(m: Path) -> None:
    (m / "model.safetensors").unlink()


def _remote_code(m: Path) -> None:
    _edit_config(m, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})


def _not_causal(m: Path) -> None:
    _edit_config(m, model_type="t5")


def _bad_json(m: Path) -> None:
    (m / "config.json").write_text("{not json")


def _missing_shard(m: Path) -> None:
    (m / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )


def _no_tokenizer(m: Path) -> None:
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json"):
        (m / name).unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("breakage", "fragments"),
    [
        (_no_config, ["has no config.json"]),
        (_pickle_only, ["pytorch_model.bin", "safetensors only", "arbitrary code"]),
        (_no_weights, ["no weights"]),
        (_remote_code, ["auto_map", "trust_remote_code"]),
        (_not_causal, ["model_type 't5'", "not a causal"]),
        (_bad_json, ["cannot read", "config.json"]),
        (_missing_shard, ["model-00002-of-00002.safetensors", "missing"]),
        (_no_tokenizer, ["no tokenizer files"]),
    ],
    ids=lambda v: getattr(v, "__name__", "")[1:] if callable(v) else "",
)
def test_validate_reads_the_model_directory(work, model_dir, capfd, breakage, fragments):
    model = copy_model(model_dir, work / "model")
    breakage(model)
    cfg = write_config(work, model={"path": str(model), "dtype": "float32"})
    code, out, err = cli(["validate", str(cfg)], capfd)
    assert code == 2 and "valid" not in out
    assert_one_paragraph(err, "model.path", *fragments)


def test_validate_reports_every_model_problem_at_once(work, model_dir, capfd):
    model = copy_model(model_dir, work / "model")
    _remote_code(model)
    _no_tokenizer(model)
    _missing_shard(model)
    cfg = write_config(work, model={"path": str(model), "dtype": "float32"})
    code, _, err = cli(["validate", str(cfg)], capfd)
    assert code == 2
    assert_one_paragraph(err, "3 problems", "trust_remote_code", "no tokenizer files", "missing")


def test_a_good_model_directory_validates(work, model_dir, capfd):
    cfg = write_config(work, model={"path": str(model_dir), "dtype": "float32"})
    code, out, err = cli(["validate", str(cfg)], capfd)
    assert code == 0, err
    assert "valid" in out


def test_tokenizer_path_without_tokenizer_files(work, model_dir, capfd):
    (work / "tok").mkdir()
    cfg = write_config(work, model={"path": str(model_dir), "tokenizer_path": str(work / "tok"), "dtype": "float32"})
    code, _, err = cli(["validate", str(cfg)], capfd)
    assert code == 2
    assert_one_paragraph(err, "model.tokenizer_path", "no tokenizer files")


# ---------------------------------------------------------------- sequence length


def test_sequence_len_beyond_the_model_is_refused_with_the_numbers(work, model_dir, capfd):
    for model in (
        {"path": str(model_dir), "dtype": "float32"},
        {"preset": "tiny-llama", "preset_overrides": {"max_position_embeddings": 128}},
    ):
        cfg = write_config(work, model=model, data={"sequence_len": 256})
        code, _, err = cli(["validate", str(cfg)], capfd)
        assert code == 2
        assert_one_paragraph(err, "data.sequence_len", "256", "128", "allow_longer_than_model")


def test_sequence_len_beyond_the_model_is_accepted_when_opted_in_with_a_warning(work, model_dir, capfd):
    cfg = write_config(
        work, model={"path": str(model_dir), "dtype": "float32"}, data={"sequence_len": 256, "allow_longer_than_model": True}
    )
    code, _, err = cli(["validate", str(cfg)], capfd)
    assert code == 0, err
    assert "warning: data.sequence_len 256 is longer than the 128 positions" in err and "quality may drop" in err


def test_sequence_len_beyond_the_model_is_accepted_with_rope_scaling(work, model_dir, capfd):
    model = copy_model(model_dir, work / "model")
    raw = json.loads((model / "config.json").read_text())
    key = "rope_parameters" if "rope_parameters" in raw else "rope_scaling"
    raw[key] = {**(raw.get(key) or {}), "rope_type": "linear", "factor": 4.0}
    (model / "config.json").write_text(json.dumps(raw))
    cfg = write_config(work, model={"path": str(model), "dtype": "float32"}, data={"sequence_len": 256})
    code, _, err = cli(["validate", str(cfg)], capfd)
    assert code == 0, err
    assert "RoPE scaling 'linear'" in err


# ---------------------------------------------------------------- data files


def test_one_malformed_jsonl_line_names_file_and_line_without_library_logs(work, capfd):
    data = write_rows(work / "data.jsonl", 10)
    lines = data.read_text().splitlines()
    lines[6] = '{"text": "broken'
    data.write_text("\n".join(lines) + "\n")
    cfg = write_config(work, data={"dataset": {"path": str(data), "type": "completion"}})
    before = snapshot(work)
    for command in ("preprocess", "train"):
        code, _, err = cli([command, str(cfg)], capfd)
        text = assert_failed_start(work, before, code, err, str(data), "line 7", "malformed JSON Lines")
        assert "Failed to load JSON" not in text and "ArrowInvalid" not in text


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_binary_garbage_is_one_paragraph_without_library_logs(work, capfd, suffix):
    data = work / f"garbage{suffix}"
    data.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4096)))
    cfg = write_config(work, data={"dataset": {"path": str(data), "type": "completion"}})
    before = snapshot(work)
    code, _, err = cli(["train", str(cfg)], capfd)
    text = assert_failed_start(work, before, code, err, str(data))
    assert "Failed to" not in text and "Skipping" not in text


def test_dataset_path_that_is_a_directory_is_caught_by_validate(work, capfd):
    (work / "shards.jsonl").mkdir()
    cfg = write_config(work, data={"dataset": {"path": str(work / "shards.jsonl"), "type": "completion"}})
    code, _, err = cli(["validate", str(cfg)], capfd)
    assert code == 2
    assert_one_paragraph(err, "data.datasets[0].path", "is a directory")


def test_too_few_rows_for_one_step_leaves_no_run_dir_and_a_consistent_cache(work, capfd):
    data = write_rows(work / "small.jsonl", 3)
    cfg = write_config(work, data={"dataset": {"path": str(data), "type": "completion"}}, training={"micro_batch_size": 4})
    before = snapshot(work)
    code, _, err = cli(["train", str(cfg)], capfd)
    assert_failed_start(work, before, code, err, "fewer than one optimizer")
    assert not (work / "run").exists()
    cache = work.parent / "cache"
    entries = [p for p in cache.iterdir() if p.is_dir()]
    assert not [p for p in entries if p.name.startswith(".tmp-")]  # no staging left
    assert all((p / "stats.json").is_file() and (p / "train").is_dir() for p in entries)
    # the same start again meets the same clean answer (and reuses the cache)
    code, _, err = cli(["train", str(cfg)], capfd)
    assert_failed_start(work, before, code, err, "fewer than one optimizer")


def test_a_failed_start_in_an_existing_directory_leaves_it_as_it_was(work, capfd):
    (work / "run").mkdir()
    (work / "run" / "notes.txt").write_text("mine")
    data = write_rows(work / "small.jsonl", 3)
    cfg = write_config(work, data={"dataset": {"path": str(data), "type": "completion"}}, training={"micro_batch_size": 4})
    before = snapshot(work)
    code, _, err = cli(["train", str(cfg)], capfd)
    assert_failed_start(work, before, code, err, "fewer than one optimizer")


# ---------------------------------------------------------------- anything else before step 1


def test_an_unexpected_exception_before_the_first_step_is_one_paragraph(work, capfd, monkeypatch):
    import hone.data.prepare

    def broken(*args, **kwargs):
        raise ValueError("the flux capacitor is empty")

    monkeypatch.setattr(hone.data.prepare, "prepare_data", broken)
    cfg = write_config(work)
    before = snapshot(work)
    code, _, err = cli(["train", str(cfg)], capfd)
    assert_failed_start(
        work, before, code, err, "before its first optimizer step", "ValueError: the flux capacitor is empty", "--verbose"
    )
    code, _, err = cli(["--verbose", "train", str(cfg)], capfd)
    assert code == 2 and "Traceback" in err and "the flux capacitor is empty" in err
    assert snapshot(work) == before


def test_disk_full_while_checkpointing_is_one_paragraph_and_keeps_the_previous(work, capfd, monkeypatch):
    import hone.train.checkpoint as ckpt

    real = ckpt._write_torch

    def full_at_step_2(directory, name, obj):
        if directory.name.startswith(".tmp-step-2"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(directory, name, obj)

    monkeypatch.setattr(ckpt, "_write_torch", full_at_step_2)
    cfg = write_config(work, training={"save_steps": 1})
    code, _, err = cli(["train", str(cfg)], capfd)
    assert code == 2
    assert_one_paragraph(err, "step-2", "No space left on device", "step-1 is intact", "training.resume: latest")
    root = work / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-1"] and ckpt.is_complete(root / "step-1")


def test_cache_and_resume_paths_that_are_files_are_caught_by_validate(work, capfd):
    (work / "cachefile").write_text("x")
    (work / "ckpt").write_text("x")
    cfg = write_config(work, data={"dataset_prepared_path": str(work / "cachefile")}, training={"resume": str(work / "ckpt")})
    code, _, err = cli(["validate", str(cfg)], capfd)
    assert code == 2
    assert_one_paragraph(
        err, "data.dataset_prepared_path", "is a file", "training.resume", "is a file, not a checkpoint directory"
    )
