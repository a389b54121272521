"""One run holds a run directory at a time.

Two ``hone train`` processes in one ``training.output_dir`` (a resume started while the first
run still lives, or a rank left over from a killed launcher) would interleave checkpoints and
metrics and both write ``final/``. The run (rank 0 of a multi-process run) holds an exclusive
``flock`` on ``<output_dir>/.hone.lock`` from its start to its end; the file names the holder's
pid and host. The kernel drops the lock when the holder dies, however it dies, so:

- a second run while the first lives is refused, naming the holder's pid and host;
- a lock file left by a holder that is gone (same host) is taken over, with a note;
- a lock file naming another host (a run directory on a shared file system) is refused: hone
  cannot tell from here whether that run lives, so the message says how to remove the file.

The lock is released (the file removed) when the run ends, normally or by an error.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hone.errors import HoneError
from hone.processes import pid_alive
from hone.run_files import LOCK_FILE


class RunDirLocked(HoneError):
    """``training.output_dir`` is held by another ``hone train``."""


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    since: str = "?"

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, since {self.since}"


def this_holder() -> Holder:
    return Holder(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S %Z"))


def read_holder(text: str) -> Holder | None:
    """The holder a lock file names, or None (empty or unreadable: nobody to name)."""
    try:
        data = json.loads(text)
        return Holder(int(data["pid"]), str(data["host"]), str(data.get("since", "?")))
    except (ValueError, KeyError, TypeError):
        return None


class RunLock:
    """``lock = RunLock(out).acquire()`` ... ``lock.release()``; ``note`` prints a take-over."""

    def __init__(self, run_dir: Path, note: Callable[[str], None] = print) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.note = note
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock (creating the directory), or raise :class:`RunDirLocked`."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = _locked_fd(self.path)
        try:
            previous = read_holder(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            me = this_holder()
            if previous is not None and previous.host != me.host:
                raise RunDirLocked(foreign_message(self.path, previous))
            if previous is not None and previous.pid != me.pid:
                state = "no longer running" if not pid_alive(previous.pid) else "no longer holding it"
                self.note(f"note: taking over the run directory lock of a run that is gone ({previous.describe()}; {state})")
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me.__dict__) + "\n").encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file (if it is still ours) and drop the lock."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                self.path.unlink()
        except OSError:
            pass  # already removed (a failed start undone), or the directory is gone
        os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *_: object) -> None:
        self.release()


def _locked_fd(path: Path) -> int:
    """An fd of ``path`` holding its exclusive flock; :class:`RunDirLocked` if another holds it.
    Retries when the file it locked was removed meanwhile (its holder released it)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            os.close(fd)
            raise RunDirLocked(held_message(path.parent, holder)) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def held_message(run_dir: Path, holder: Holder | None) -> str:
    who = holder.describe() if holder is not None else "a process that has not written its name yet"
    return (
        f"training.output_dir '{run_dir}' is in use by another hone train ({who}): two runs in one "
        "directory would overwrite each other's checkpoints. Wait for it to end or stop it, or pick "
        "another training.output_dir"
    )


def foreign_message(path: Path, holder: Holder) -> str:
    return (
        f"training.output_dir '{path.parent}' is locked by a hone train on another host ({holder.describe()}); "
        f"hone cannot tell from here whether that run still lives. If it does not, delete {path} and start again"
    )


def lock_problem(run_dir: Path) -> str | None:
    """Why a run cannot take ``run_dir`` now (held by a live run, or locked from another host),
    or None; takes nothing and creates nothing (the launcher's check before it starts the ranks)."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return held_message(Path(run_dir), read_holder(text))
        holder = read_holder(text)
        if holder is not None and holder.host != socket.gethostname():
            return foreign_message(path, holder)
        return None
    finally:
        os.close(fd)
