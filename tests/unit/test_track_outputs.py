"""metrics.jsonl, TensorBoard events, loss.png, console progress and the end-of-run report."""

import io
import json
import math
import os
import random
import stat
from pathlib import Path

from rich.console import Console

from hone.atomic import atomic_write_text, atomic_write_with
from hone.config.logging import LoggingConfig
from hone.track.metrics import MetricsLog, read_metrics
from hone.track.plot import plot_losses
from hone.track.report import format_report
from hone.track.tracker import Tracker


def _train_row(step: int, loss: float) -> dict:
    return {"step": step, "epoch": step / 10, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0}


def test_metrics_rows_are_appended_flushed_and_nan_becomes_null(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    losses = [random.uniform(1, 5) for _ in range(3)]
    for step, loss in enumerate(losses, 1):
        log.append(_train_row(step, loss))
        # flushed per row: readable while the log is still open
        assert [r["loss"] for r in read_metrics(path)] == losses[:step]
    log.append({**_train_row(4, math.nan), "grad_norm": math.inf})
    log.append({"step": 4, "eval_loss": 2.0, "eval_ppl": math.exp(2.0)})
    log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 5
    json.loads(lines[3], parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))  # strict JSON
    assert read_metrics(path)[3]["loss"] is None and read_metrics(path)[3]["grad_norm"] is None
    assert [r["step"] for r in log.train_rows] == [1, 2, 3, 4] and len(log.eval_rows) == 1


def test_resuming_drops_rows_after_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(1, 8):
        log.append(_train_row(step, 1.0 / step))
    log.append({"step": 4, "eval_loss": 0.3})
    log.close()
    with open(path, "a") as f:
        f.write('{"step": 8, "loss"')  # a row torn by a kill mid-write
    resumed = MetricsLog(path, resume_step=4)
    assert [r["step"] for r in resumed.rows] == [1, 2, 3, 4, 4]
    resumed.append(_train_row(5, 0.5))
    resumed.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 4, 5]


def test_resuming_into_a_new_directory_restores_rows_from_the_checkpoint(tmp_path):
    history = [_train_row(s, 1.0) for s in (1, 2, 3)]
    log = MetricsLog(tmp_path / "new" / "metrics.jsonl", resume_step=2, history=history)
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "new" / "metrics.jsonl")] == [1, 2]


def test_loss_plot_is_a_png_written_atomically(tmp_path):
    rows = [_train_row(s, 3.0 / s) for s in range(1, 20)] + [{"step": s, "eval_loss": 2.0 / (s + 1)} for s in (0, 10, 19)]
    rows[5]["loss"] = None  # a skipped step
    target = plot_losses(rows, tmp_path / "loss.png", title="run")
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["loss.png"]  # no temp file left


def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path):
    target = tmp_path / "config.yml"
    atomic_write_text(target, "old")

    def broken(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    try:
        atomic_write_with(target, broken)
    except OSError:
        pass
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yml"]


def test_atomic_writes_follow_the_umask_even_when_the_writer_makes_a_private_file(tmp_path):
    def private(tmp: Path) -> None:  # as safetensors and mkstemp do
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"weights")
        os.close(fd)

    previous = os.umask(0o022)
    try:
        atomic_write_with(tmp_path / "w.safetensors", private)
        atomic_write_text(tmp_path / "c.yml", "a: 1\n")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "w.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "c.yml").stat().st_mode) == 0o644


def test_tensorboard_events_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggingConfig(tensorboard=True, plot=True, progress_bar=False)
    tracker = Tracker(cfg, tmp_path, Console(file=io.StringIO()), total_steps=3)
    losses = [random.uniform(1, 3) for _ in range(3)]
    for step, loss in enumerate(losses, 1):
        tracker.log_train(_train_row(step, loss))
    tracker.log_eval({"step": 3, "eval_loss": 1.5, "eval_ppl": math.exp(1.5), "eval_tokens": 10})
    plot = tracker.close()
    assert plot == tmp_path / "loss.png" and plot.exists()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert all(abs(e.value - x) < 1e-5 for e, x in zip(events.Scalars("train/loss"), losses, strict=True))
    assert abs(events.Scalars("eval/loss")[0].value - 1.5) < 1e-6


def test_plain_progress_lines_when_not_a_terminal(tmp_path):
    out = io.StringIO()
    cfg = LoggingConfig(tensorboard=False, plot=False, progress_bar=True)
    tracker = Tracker(cfg, tmp_path, Console(file=out, width=200), total_steps=5)
    tracker.log_train(_train_row(1, 2.5))
    tracker.log_train({**_train_row(2, math.nan), "skipped": True})
    assert tracker.close() is None
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/5 | loss 2.5000 | lr 1.00e-03") and "tok/s" in lines[0] and "eta" in lines[0]
    assert "skipped" in lines[1]


def test_live_bar_on_a_terminal(tmp_path):
    out = io.StringIO()
    cfg = LoggingConfig(tensorboard=False, plot=False, progress_bar=True)
    tracker = Tracker(cfg, tmp_path, Console(file=out, force_terminal=True, width=160), total_steps=4)
    assert tracker.display.live
    for step in range(1, 5):
        tracker.log_train(_train_row(step, 1.2345))
    tracker.close()
    text = out.getvalue()
    assert "step 4/4" in text and "loss 1.2345" in text and "tok/s" in text


def test_report_names_steps_losses_change_and_outputs(tmp_path):
    (tmp_path / "final").mkdir()
    text = format_report(
        steps=10,
        total_steps=10,
        start_step=4,
        elapsed_s=12.0,
        wall_s=75.0,
        tokens=1200,
        trained_tokens=800,
        final_loss=1.25,
        eval_losses=[(0, 2.0), (10, 1.5)],
        skipped_steps=1,
        interrupted=None,
        output_dir=tmp_path,
        final_dir=tmp_path / "final",
        last_checkpoint=tmp_path / "checkpoints" / "step-10",
        extra_outputs=[tmp_path / "metrics.jsonl"],
    )
    assert "step 10/10" in text and "6 steps in 0:01:15" in text and "resumed at step 4" in text
    assert "100 tokens/s" in text and "1.2500" in text
    assert "2.0000 (step 0) -> 1.5000 (step 10) (-25.0%)" in text
    assert "skipped steps" in text and "final/" in text and "checkpoints/step-10/" in text and "metrics.jsonl" in text
