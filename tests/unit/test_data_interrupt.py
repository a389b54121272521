"""Ctrl-C during data preparation: exit 130, no cache entry published, no staging left.

Through the CLI with real signals (the window a user hits), and in process for an interrupt
that a library swallows on its way up (``datasets`` hashes transform arguments under a bare
``except:``): the build must still stop and publish nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hone.data.prepare as prepare_module
from hone.data.cache import STAGING_PREFIX
from hone.data.prepare import prepare_data

REPO = Path(__file__).resolve().parents[2]
WORDS = "the of and to a in is you that it he was for on are as with his they at be this".split()


def alpaca_file(directory: Path, rows: int) -> Path:
    path = directory / "alpaca.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for i in range(rows):
            text = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(60))
            f.write(json.dumps({"instruction": f"row {i}: {text[:80]}", "input": "", "output": text}) + "\n")
    return path


def entries(cache: Path) -> tuple[list[str], list[str]]:
    """(published entries, staging directories) under the cache root."""
    names = sorted(p.name for p in cache.iterdir() if p.is_dir()) if cache.is_dir() else []
    return [n for n in names if not n.startswith(STAGING_PREFIX)], [n for n in names if n.startswith(STAGING_PREFIX)]


def wait_for_staging(proc: subprocess.Popen, cache: Path, limit_s: float = 240.0) -> None:
    deadline = time.monotonic() + limit_s
    while not (cache.is_dir() and any(p.name.startswith(STAGING_PREFIX) for p in cache.iterdir())):
        if proc.poll() is not None:
            pytest.fail(f"hone preprocess ended (rc {proc.returncode}) before it started preparing: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("no staging directory appeared")
        time.sleep(0.02)


@pytest.mark.slow  # a hone process each: its start dominates (about 15 s on a loaded 2-core machine)
@pytest.mark.parametrize(
    "num_proc,to_group", [(None, False), (2, False), (2, True)], ids=["one-process", "num_proc-2", "num_proc-2-terminal"]
)
def test_ctrl_c_in_preprocess_exits_130_and_publishes_nothing(tmp_path, num_proc, to_group):
    """SIGINT to the hone process (``kill -INT``) once the staging directory exists, or to its
    whole process group (``to_group``: a terminal's Ctrl-C, which its workers get too). With
    num_proc, datasets' worker pool used to turn the interrupt into a TimeoutError (exit 1), and
    a Ctrl-C at a terminal killed each worker with a traceback."""
    data = alpaca_file(tmp_path, 40_000)  # seconds of tokenizing even on a fast machine
    cache = tmp_path / "cache"
    options = {"path": str(data), "type": "alpaca"}
    config = {
        "model": {"preset": "tiny-llama"},
        "data": {"datasets": [options], "sequence_len": 256, "dataset_prepared_path": str(cache)},
    }
    if num_proc:
        config["data"]["num_proc"] = num_proc
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"}  # SIGABRT: every thread's stack
    proc = subprocess.Popen(
        [sys.executable, "-m", "hone", "preprocess", str(cfg)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, so that its workers can be cleaned up below
    )
    try:
        wait_for_staging(proc, cache)
        time.sleep(0.3)  # into loading / tokenizing
        if to_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # still running: show where it waits, then fail
            proc.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            # its workers (the same process group) may hold stderr open after it died: end them, then read
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate(timeout=30)
            pytest.fail(f"hone preprocess still ran 120 s after SIGINT; its threads:\n{stderr[-6000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its workers too, whether or not it exited
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert entries(cache) == ([], [])


def test_an_interrupt_swallowed_by_a_library_still_stops_the_build(tmp_path, make_data_config, tokenizer, monkeypatch):
    """SIGINT arrives while a library catches everything (as datasets' fingerprinting does):
    the KeyboardInterrupt never reaches hone, yet nothing may be published."""
    data = alpaca_file(tmp_path, 50)
    cfg = make_data_config([{"path": data, "type": "alpaca"}], sequence_len=256)
    real = prepare_module._write_split

    def write_split_while_a_library_swallows_the_interrupt(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here
        except:  # noqa: E722 - what the library does
            pass
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "_write_split", write_split_while_a_library_swallows_the_interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, tokenizer)
    assert entries(tmp_path / "cache") == ([], [])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler was put back


def test_an_exception_that_replaces_the_interrupt_is_reported_as_it(tmp_path, make_data_config, tokenizer, monkeypatch):
    data = alpaca_file(tmp_path, 50)
    cfg = make_data_config([{"path": data, "type": "alpaca"}], sequence_len=256)

    def write_split_like_a_worker_pool(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        finally:
            raise TimeoutError  # noqa: B012 - what datasets' iflatmap_unordered does in its finally

    monkeypatch.setattr(prepare_module, "_write_split", write_split_like_a_worker_pool)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, tokenizer)
    assert entries(tmp_path / "cache") == ([], [])


def test_an_interrupt_python_cannot_raise_is_kept_quiet_and_still_stops_the_build(monkeypatch):
    """SIGINT inside a finalizer (or an at-fork hook: logging's, while datasets forks its workers)
    is "ignored" by Python, which prints it with a traceback; the flag still stops the build, so
    the hook drops that print, and only that one."""
    from hone.data.interrupt import interruptible

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(type(unraisable.exc_value)))

    class SignalledWhileFinalized:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)

    class FailsWhileFinalized:
        def __del__(self):
            raise ValueError("not an interrupt")

    with pytest.raises(KeyboardInterrupt), interruptible():
        SignalledWhileFinalized()  # collected at once: the handler raises inside __del__
        FailsWhileFinalized()
    assert seen == [ValueError]
    assert sys.unraisablehook is not None and sys.unraisablehook.__name__ == "<lambda>"  # put back


FORK_SCRIPT = """
import os, signal, threading
lock = threading.Lock()  # stands for logging's module lock, which its at-fork hooks take and release


def after_in_parent():
    signal.raise_signal(signal.SIGINT)  # Ctrl-C while the hook runs
    lock.release()


os.register_at_fork(before=lock.acquire, after_in_parent=after_in_parent, after_in_child=lock.release)
from hone.data.interrupt import interruptible  # registers its own hooks after these, as after logging's

try:
    with interruptible():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        print("lock released:", lock.acquire(timeout=5))
except KeyboardInterrupt:
    print("interrupted")
"""


def test_an_interrupt_while_forking_lets_the_at_fork_hooks_finish_then_stops_the_build():
    """SIGINT inside an at-fork hook registered before hone's (logging's releases its module lock
    there while datasets forks a worker): the hook runs to its end, so no lock is left held
    (``hone preprocess`` with ``num_proc`` hung on one in CI), and the flag stops the block."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", FORK_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[:2] == ["lock released: True", "interrupted"], out.stdout + out.stderr[-2000:]


WORKER_SCRIPT = """
import os, signal, sys, time
if sys.argv[1] == "in-fork":  # the SIGINT lands while the worker is forked (runs after hone's "before" hook)
    os.register_at_fork(before=lambda: signal.raise_signal(signal.SIGINT))
from hone.data.interrupt import WorkersStopped, check_interrupted, interruptible, workers_run

pid = None
try:
    with interruptible(), workers_run():
        pid = os.fork()
        if pid == 0:  # a worker: 2,000 batches of 10 ms unless stopped
            try:
                for _ in range(2000):
                    check_interrupted()
                    time.sleep(0.01)
            except WorkersStopped:
                os._exit(4)
            except KeyboardInterrupt:
                os._exit(3)
            os._exit(0)
        if sys.argv[1] == "after-fork":
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while the worker runs
        print("parent went on")
        print("worker exit:", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
except KeyboardInterrupt:
    print("interrupted")
"""


@pytest.mark.parametrize("when", ["after-fork", "in-fork"])
def test_an_interrupt_while_workers_run_stops_them_at_their_next_batch_then_the_parent(when):
    """``hone preprocess`` with ``num_proc``: the parent waits on forked workers
    (``workers_run``). The first SIGINT raises nothing in the parent (raised inside
    ``multiprocess``'s pool machinery it could leave ``Pool.terminate`` hanging); the worker
    raises ``WorkersStopped`` (an Exception the pool hands back, not a ``KeyboardInterrupt`` that
    kills it with a traceback) at its next batch, and the parent reports the interrupt when the
    block ends. Also when the SIGINT lands while the worker is forked. Without the shared stop the
    worker runs its 2,000 batches and exits 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", WORKER_SCRIPT, when], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[:3] == ["parent went on", "worker exit: 4", "interrupted"], out.stdout + out.stderr[-2000:]


def test_a_second_interrupt_while_workers_run_raises_at_once():
    from hone.data.interrupt import interruptible, workers_run

    reached = []
    with pytest.raises(KeyboardInterrupt), interruptible(), workers_run():
        signal.raise_signal(signal.SIGINT)  # the first: workers would stop; nothing raised here
        reached.append("after the first")
        signal.raise_signal(signal.SIGINT)  # the user insists
        reached.append("after the second")
    assert reached == ["after the first"]
