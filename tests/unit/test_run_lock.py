"""One run holds a run directory at a time (issue 30, item 13): refused while held, a stale lock
of a dead holder taken over with a note, a lock from another host reported, released at the end."""

import json
import socket
import subprocess
import sys

import pytest

from hone.cli import main
from hone.run_files import LOCK_FILE
from hone.train.run_lock import RunDirLocked, RunLock, lock_problem
from hone.train.start_guard import StartFailed, StartGuard


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_held_lock_refuses_a_second_holder_naming_pid_and_host(tmp_path):
    run = tmp_path / "run"
    with RunLock(run, note=pytest.fail):
        written = json.loads((run / LOCK_FILE).read_text())
        assert written["host"] == socket.gethostname()
        want = f"in use by another hone train \\(pid {written['pid']} on host {socket.gethostname()}"
        with pytest.raises(RunDirLocked, match=want):
            RunLock(run).acquire()  # its own open file: flock refuses it even in the same process
        assert "in use by another hone train" in lock_problem(run)
    assert not (run / LOCK_FILE).exists() and lock_problem(run) is None  # released: the file is gone
    RunLock(run, note=pytest.fail).acquire().release()  # and the next run takes it without a note


def test_a_stale_lock_of_a_dead_holder_is_taken_over_with_a_note(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    pid = dead_pid()
    (run / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "since": "then"}))
    assert lock_problem(run) is None
    notes = []
    lock = RunLock(run, note=notes.append).acquire()
    assert len(notes) == 1 and f"pid {pid} on host {socket.gethostname()}" in notes[0] and "no longer running" in notes[0]
    lock.release()


def test_a_lock_from_another_host_is_reported_with_how_to_remove_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text(json.dumps({"pid": 4242, "host": "other-node-7"}))
    for message in (lock_problem(run), None):
        if message is None:
            with pytest.raises(RunDirLocked) as caught:
                RunLock(run, note=pytest.fail).acquire()
            message = str(caught.value)
        assert "pid 4242 on host other-node-7" in message and f"delete {run / LOCK_FILE}" in message
    assert (run / LOCK_FILE).exists()  # never removed for the user


def test_hone_train_is_refused_while_another_run_holds_the_directory(tmp_path, capsys):
    import yaml

    run = tmp_path / "run"
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [5, 6, 7, 8]}\n' * 8)
    cfg = {
        "model": {"preset": "tiny-llama", "dtype": "float32"},
        "data": {"datasets": [{"path": str(data), "type": "pretokenized"}], "sequence_len": 16},
        "training": {"output_dir": str(run), "max_steps": 1},
    }
    (tmp_path / "c.yml").write_text(yaml.safe_dump(cfg))
    with RunLock(run):
        (run / "metrics.jsonl").write_text("")  # the living run's files: never undone by the refused one
        assert main(["train", str(tmp_path / "c.yml")]) == 2
        assert main(["train", str(tmp_path / "c.yml"), "--nproc-per-node", "2"]) == 2  # the launcher's check
        err = capsys.readouterr().err
        assert err.count("is in use by another hone train (pid ") == 2 and "Traceback" not in err
        assert (run / "metrics.jsonl").exists() and (run / LOCK_FILE).exists()


def test_a_failed_start_releases_the_lock_and_leaves_nothing(tmp_path):
    run = tmp_path / "a" / "run"
    with pytest.raises(StartFailed), StartGuard() as guard:
        guard.watch(run)
        assert (run / LOCK_FILE).exists()
        raise RuntimeError("boom")
    assert not (tmp_path / "a").exists()
    run.mkdir(parents=True)
    (run / "config.yml").write_text("x")
    with pytest.raises(StartFailed), StartGuard() as guard:
        guard.watch(run)
        raise ValueError("boom")
    assert sorted(p.name for p in run.iterdir()) == ["config.yml"]
    RunLock(run, note=pytest.fail).acquire().release()  # released: the next run takes it
