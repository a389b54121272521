"""Running kernel checks under Triton's interpreter from a test.

``TRITON_INTERPRET=1`` must be set before triton is imported, so a test that checks a Triton
kernel on the CPU runs its checks in another Python process with it set (this checkout first on
the import path) and reads back what the checks measured: the JSON after the last line's
``RESULT `` marker. That process lives as long as the test process
(tests/interpreted_worker.py): each check runs in it as ``__main__``, so a case costs its own
work, not a fresh interpreter importing torch, triton and hone (seconds a case, most of the
kernel tests' time when every case started its own). A check that raises fails its test with
the traceback; one that kills the process or runs past its timeout fails its test with the end
of the process's stderr, and the next check starts a new process.
"""

import atexit
import importlib.util
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from interpreted_worker import REPLY

ROOT = Path(__file__).resolve().parents[1]
MARKER = "RESULT "

#: Skips a test of a Triton kernel where triton is not installed (a CPU-only torch brings none).
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (CPU-only torch); the GPU tests cover it"
)
WORKER = Path(__file__).with_name("interpreted_worker.py")


class _Worker:
    """The interpreter process and a thread that reads its stdout lines into a queue (so a
    check's timeout can be waited for without blocking on a pipe)."""

    def __init__(self) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # the process's stdout closed: it ended

    def ask(self, args: list[str], timeout_s: float) -> dict:
        self.proc.stdin.write(json.dumps({"args": args}) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.lines.get(timeout=timeout_s)
            if line is None:
                raise RuntimeError(f"the interpreter process ended (code {self.proc.wait()}):\n{self.stderr_tail()}")
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY) :])

    def stderr_tail(self, chars: int = 4000) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


_worker: _Worker | None = None


def _stop_worker() -> None:
    global _worker
    if _worker is not None:
        _worker.stop()
        _worker = None


atexit.register(_stop_worker)


def run_interpreted(args: list[str], timeout_s: int = 600) -> dict:
    """``python *args`` with ``TRITON_INTERPRET=1`` (in the long-lived process); the JSON of its
    ``RESULT `` line."""
    global _worker
    if _worker is None or _worker.proc.poll() is not None:
        _stop_worker()
        _worker = _Worker()
    try:
        reply = _worker.ask(args, timeout_s)
    except queue.Empty:
        tail = _worker.stderr_tail()
        _stop_worker()
        raise AssertionError(f"the check ran past {timeout_s} s: {args[:2]}\n{tail}") from None
    except RuntimeError as ended:
        _stop_worker()
        raise AssertionError(str(ended)) from None
    assert not reply["error"], reply["error"][-4000:]
    lines = [line for line in reply["stdout"].splitlines() if line.startswith(MARKER)]
    assert lines, f"the check printed no {MARKER!r} line; its output ended:\n{reply['stdout'][-2000:]}"
    return json.loads(lines[-1][len(MARKER) :])
