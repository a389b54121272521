"""Ctrl-C during ``hone train``, through the CLI with real signals: one press says at once what
will happen and stops after the step with a checkpoint; a second press stops now and says what
was saved; the half-run directory is then resumable or overwritable (``--overwrite``)."""

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hone.cli import main
from hone.track.metrics import read_metrics
from hone.train.checkpoint import latest_checkpoint, list_checkpoints

pytest.importorskip("hone.data.prepare", reason="hone.data (prepare_data) has not landed")

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 240  # a loaded CI machine: generous limits, never a timing assertion


def _config(tmp_path: Path, **training) -> Path:
    """A tiny full fine-tune whose steps take 8 micro-batches each (long enough to press twice)."""
    words = ["red", "green", "blue", "lemon", "lime", "fox", "dog", "quick", "lazy", "yellow"]
    rng = random.Random(0)
    rows = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))} for _ in range(160)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {"max_steps": 40, "micro_batch_size": 1, "gradient_accumulation_steps": 8, "output_dir": str(tmp_path / "run")}
    settings.update(training)
    cfg = {
        "model": {"preset": "tiny-llama", "dtype": "float32"},
        "data": {
            "datasets": [{"path": str(tmp_path / "data.jsonl"), "type": "completion"}],
            "sequence_len": 32,
            "dataset_prepared_path": str(tmp_path / "cache"),
        },
        "adapter": {"type": "none"},
        "training": settings,
        "optimizer": {"learning_rate": 1e-3, "fused": False},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
    }
    path = tmp_path / "cfg.yml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


class Train:
    """``hone train CFG`` in a child process, its stdout and stderr read line by line (together,
    so their order is kept)."""

    def __init__(self, config: Path):
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hone", "train", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, also=lambda: True) -> str:
        """The first line matching ``pattern`` (once ``also()`` holds too)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"hone train ended before {pattern!r}:\n" + "\n".join(self.lines))
            self.lines.append(line)
            if re.search(pattern, line):
                while not also():  # e.g. the step's checkpoint, published right after its row
                    assert self.proc.poll() is None, "\n".join(self.lines)
                    time.sleep(0.01)
                return line
        raise AssertionError(f"no {pattern!r} within {WAIT_S} s:\n" + "\n".join(self.lines))

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def finish(self) -> tuple[int, str]:
        rc = self.proc.wait(timeout=WAIT_S)
        while (line := self._queue.get(timeout=WAIT_S)) is not None:
            self.lines.append(line)
        return rc, "\n".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def train():
    started: list[Train] = []

    def start(config: Path) -> Train:
        started.append(Train(config))
        return started[-1]

    yield start
    for run in started:
        run.kill()


def test_one_ctrl_c_says_so_at_once_and_stops_after_the_step_with_a_resumable_checkpoint(tmp_path, train):
    config = _config(tmp_path)
    run = train(config)
    run.wait_for(r"^step 1/40 \|")  # written while step 2 computes
    run.interrupt()
    said = run.wait_for(r"Ctrl-C: stopping after step")
    rc, out = run.finish()
    assert rc == 130, out
    step = int(re.search(r"stopping after step (\d+) finishes", said).group(1))
    assert said == (
        f"Ctrl-C: stopping after step {step} finishes; a checkpoint will be saved. "
        "Press Ctrl-C again to stop now without finishing the step."
    )
    assert out.count("Ctrl-C: stopping after step") == 1
    # said before the step finished: the stop line comes after it
    assert out.index(said) < out.index(f"Stopped by SIGINT after step {step}/40")
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [step]
    assert not (tmp_path / "run" / "final").exists()

    # resumable: training.resume: latest continues from that checkpoint
    assert main(["train", str(config), "--set", "training.resume=latest", "--set", f"training.max_steps={step + 1}"]) == 0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, step + 2))
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()


def test_a_second_ctrl_c_stops_now_says_what_was_saved_and_the_directory_can_be_resumed_or_overwritten(tmp_path, train, capsys):
    config = _config(tmp_path, save_steps=1)
    run = train(config)
    first = tmp_path / "run" / "checkpoints" / "step-1" / "COMPLETE"
    run.wait_for(r"^step 1/40 \|", also=first.exists)
    run.interrupt()
    run.wait_for(r"Ctrl-C: stopping after step")
    run.interrupt()
    rc, out = run.finish()
    assert rc == 130, out
    latest = latest_checkpoint(tmp_path / "run")
    assert latest is not None  # step-1 at least
    saved = re.search(r"Saved: checkpoint step (\d+) at (\S+)\.", out)
    assert saved is not None, out
    assert (int(saved.group(1)), Path(saved.group(2))) == (list_checkpoints(tmp_path / "run")[-1][0], latest)
    assert "training.resume=latest" in out and "--overwrite" in out
    assert "interrupted" not in out.splitlines()  # not the old bare word

    # the same command again is refused with the ways on, resume among them (it would continue)
    capsys.readouterr()
    assert main(["train", str(config)]) == 2
    refused = capsys.readouterr().err
    assert "an unfinished run (last checkpoint: step" in refused
    assert "training.resume: latest" in refused and "--overwrite" in refused

    # resumable: training.resume: latest continues from the checkpoint the line named
    last = int(saved.group(1))
    assert main(["train", str(config), "--set", "training.resume=latest", "--set", f"training.max_steps={last + 1}"]) == 0
    assert f"resumed from {latest} at step {last}" in capsys.readouterr().out
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, last + 2))

    # finished: the message offers --overwrite or another directory, not a resume that trains nothing
    assert main(["train", str(config), "--set", f"training.max_steps={last + 1}"]) == 2
    refused = capsys.readouterr().err
    assert "already holds a finished run" in refused and "--overwrite" in refused
    assert "resume" not in refused

    # overwritable: --overwrite starts over (a short run, to the end)
    assert main(["train", str(config), "--overwrite", "--set", "training.max_steps=1"]) == 0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1]
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [1]
    assert "removed the earlier run" in capsys.readouterr().err
