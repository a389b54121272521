"""StartGuard and the cheap model-file checks, without the CLI."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from hone.errors import HoneError
from hone.models.model_dir import safetensors_problem
from hone.train.start_guard import StartFailed, StartGuard


def test_guard_undoes_new_files_and_restores_overwritten_ones(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "config.yml").write_text("the resumed run's config")
    (run / "checkpoints" / "step-2" / "COMPLETE").write_text("{}")
    with pytest.raises(StartFailed) as info:
        with StartGuard() as guard:
            guard.watch(run)
            (run / "config.yml").write_text("a new config")
            (run / "optimizations.json").write_text("{}")
            (run / "tensorboard").mkdir()
            (run / "tensorboard" / "events").write_text("x")
            (run / "checkpoints" / ".tmp-step-3").mkdir()
            raise KeyError("no such column")
    assert "KeyError: 'no such column'" in str(info.value) and "--verbose" in str(info.value)
    assert isinstance(info.value.__cause__, KeyError)
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == [
        "checkpoints",
        "checkpoints/step-2",
        "checkpoints/step-2/COMPLETE",
        "config.yml",
    ]
    assert (run / "config.yml").read_text() == "the resumed run's config"


def test_guard_removes_the_directories_it_created_and_passes_hone_errors_on(tmp_path):
    with pytest.raises(HoneError, match="bad data") as info:
        with StartGuard() as guard:
            guard.watch(tmp_path / "a" / "b" / "run")
            (tmp_path / "a" / "b" / "run").mkdir(parents=True, exist_ok=True)  # the guard took its lock: it exists
            (tmp_path / "a" / "b" / "run" / "config.yml").write_text("x")
            raise HoneError("bad data")
    assert not isinstance(info.value, StartFailed)
    assert list(tmp_path.iterdir()) == []


def test_guard_keeps_everything_once_the_first_step_ran(tmp_path):
    with pytest.raises(RuntimeError):
        with StartGuard() as guard:
            guard.watch(tmp_path / "run")
            (tmp_path / "run").mkdir(exist_ok=True)
            guard.on_step(object())
            raise RuntimeError("a bug after step 1 keeps its traceback")
    assert (tmp_path / "run").is_dir()


def _safetensors(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(3, 4), "b": torch.randn(5)}, str(path))
    return path


def test_safetensors_check_accepts_a_good_file_and_catches_damage(tmp_path):
    path = _safetensors(tmp_path)
    good = path.read_bytes()
    assert safetensors_problem(path) is None
    path.write_bytes(good + b"\0" * 7)
    assert "7 bytes follow" in safetensors_problem(path)
    path.write_bytes(good[:-1])
    assert "truncated" in safetensors_problem(path)
    path.write_bytes(good[:5])
    assert "truncated" in safetensors_problem(path)
    (header_len,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8 : 8 + header_len])
    header["a"]["shape"] = [4, 4]  # 64 bytes of F32 claimed by 48 bytes of offsets
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= header_len
    text = text.ljust(header_len)
    path.write_bytes(good[:8] + text + good[8 + header_len :])
    assert "tensor 'a'" in safetensors_problem(path) and "corrupt" in safetensors_problem(path)
