"""The run directory: a run is never trained into afresh, and the resolved config is saved;
``training.overwrite_output_dir`` clears a run directory, and only a run directory."""

import fcntl
import json
import os
import signal

import pytest
from pydantic import ValidationError

from hone.config.loader import load_config
from hone.testing import tiny_config
from hone.train.rerun import NotARunDir, clear_run_dir, stopped_now_message
from hone.train.run import OutputDirInUse, prepare_output_dir
from hone.train.signals import StopNow, graceful_stop


def test_a_new_directory_gets_the_resolved_config(tmp_path):
    # LoRA: dump_config writes every default, and for adapter.type none that includes the
    # lora_* keys, which the loader then refuses (reported to the config owner).
    cfg = tiny_config(tmp_path / "run", adapter={"type": "lora"})
    assert prepare_output_dir(cfg, warn=pytest.fail) is None
    assert load_config(tmp_path / "run" / "config.yml") == cfg
    # config.yml alone (a run that failed while loading) does not block a retry
    assert prepare_output_dir(cfg, warn=pytest.fail) is None


def _checkpoint(run, step):
    path = run / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text(json.dumps({"step": step}))
    return path


@pytest.mark.parametrize(
    ("leftover", "what", "resume"),
    [
        ("metrics.jsonl", "a run that stopped before its first checkpoint", False),
        ("checkpoint", r"an unfinished run \(last checkpoint: step 2\)", True),
        ("final", "a finished run", False),
    ],
)
def test_a_directory_holding_a_run_is_refused_and_the_ways_on_that_do_something_are_named(tmp_path, leftover, what, resume):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    if leftover != "metrics.jsonl":
        _checkpoint(run, 2)
    if leftover == "final":
        (run / "final").mkdir()
    with pytest.raises(OutputDirInUse, match=f"already holds {what}.*--overwrite.*another training.output_dir") as refused:
        prepare_output_dir(tiny_config(run, training={"max_steps": 2}), warn=pytest.fail)
    assert ("resume: latest" in str(refused.value)) == resume


def test_a_finished_run_is_offered_resume_only_when_max_steps_asks_for_more(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, 4)
    (run / "final").mkdir()
    with pytest.raises(OutputDirInUse, match="train it on from step 4 to 10 with training.resume: latest"):
        prepare_output_dir(tiny_config(run, training={"max_steps": 10}), warn=pytest.fail)
    with pytest.raises(OutputDirInUse) as refused:
        prepare_output_dir(tiny_config(run, training={"max_steps": 4}), warn=pytest.fail)
    assert "resume" not in str(refused.value)


def test_overwrite_clears_a_run_directory_and_starts_over(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, 3)
    for name in ("metrics.jsonl", "config.yml", "optimizations.json", ".config.yml.tmp-123"):
        (run / name).write_text("old")
    (run / "final").mkdir()
    said = []
    cfg = tiny_config(run, adapter={"type": "lora"}, training={"overwrite_output_dir": True})
    assert prepare_output_dir(cfg, warn=said.append) is None
    assert sorted(p.name for p in run.iterdir()) == ["config.yml"] and load_config(run / "config.yml") == cfg
    assert len(said) == 1 and "removed the earlier run's" in said[0] and "checkpoints" in said[0]


def test_overwrite_refuses_a_directory_that_is_not_a_run_directory_and_removes_nothing(tmp_path):
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text("a run's")
    (mine / "notes.txt").write_text("not hone's")
    (mine / "src").mkdir()
    with pytest.raises(NotARunDir, match=r"not look like a hone run directory: it holds notes.txt, src.*Nothing was removed"):
        prepare_output_dir(tiny_config(mine, training={"overwrite_output_dir": True}), warn=pytest.fail)
    assert sorted(p.name for p in mine.iterdir()) == ["metrics.jsonl", "notes.txt", "src"]


def test_overwrite_keeps_the_lock_file_and_refuses_a_directory_whose_lock_is_held(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, 1)
    (run / "metrics.jsonl").write_text("")
    lock = run / ".hone.lock"
    lock.write_text('{"pid": 1, "host": "elsewhere"}')
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a run that still lives
        with pytest.raises(OutputDirInUse, match="is in use: another process holds its .hone.lock.*Nothing was removed"):
            clear_run_dir(run)
        assert sorted(p.name for p in run.iterdir()) == [".hone.lock", "checkpoints", "metrics.jsonl"]
    finally:
        os.close(fd)
    assert clear_run_dir(run) == ["checkpoints", "metrics.jsonl"]  # a stale lock: kept for its taker
    assert [p.name for p in run.iterdir()] == [".hone.lock"]
    assert clear_run_dir(run) == []


def test_overwrite_and_resume_together_are_refused_at_validation(tmp_path):
    with pytest.raises(ValidationError, match="overwrite_output_dir.*resume.*not both"):
        tiny_config(tmp_path, training={"overwrite_output_dir": True, "resume": "latest"})


def test_what_a_run_stopped_at_once_says_it_left(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    nothing = stopped_now_message(run, 3, started=True)
    assert "during step 3" in nothing and "Nothing was saved" in nothing and "--overwrite" in nothing
    assert "nothing was saved and training.output_dir was left as it was" in stopped_now_message(run, None, started=False)
    path = _checkpoint(run, 2)
    saved = stopped_now_message(run, 3, started=True)
    assert f"Saved: checkpoint step 2 at {path}." in saved and "training.resume=latest" in saved


def test_a_signal_is_answered_at_once_and_names_the_step_the_run_stops_after(capfd):
    with graceful_stop() as stop:
        assert not stop.after_step(4)  # step 5 in progress
        signal.raise_signal(signal.SIGINT)
        assert stop.requested and capfd.readouterr().err == (
            "\nCtrl-C: stopping after step 5 finishes; a checkpoint will be saved. "
            "Press Ctrl-C again to stop now without finishing the step.\n"
        )
        assert stop.after_step(5)
        with pytest.raises(StopNow) as now:
            signal.raise_signal(signal.SIGINT)
        assert now.value.step == 6 and isinstance(now.value, KeyboardInterrupt)
    assert capfd.readouterr().err == ""  # said once


def test_a_signal_after_a_steps_check_is_for_the_next_step(capfd):
    with graceful_stop() as stop:
        assert not stop.after_step(1)
        signal.raise_signal(signal.SIGTERM)  # arrives once step 1 was checked: stops after step 2
        assert "SIGTERM: stopping after step 2 finishes" in capfd.readouterr().err
        assert not stop.after_step(1) and stop.after_step(2)


def test_resume_latest_with_nothing_saved_starts_over_with_a_warning(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    warnings = []
    cfg = tiny_config(tmp_path / "run", training={"resume": "latest"})
    assert prepare_output_dir(cfg, warn=warnings.append) is None
    assert any("from scratch" in w for w in warnings) and any("starting over" in w for w in warnings)
