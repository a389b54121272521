"""A failed start leaves nothing behind: ``hone train`` either reaches its first optimizer
step or puts the run directory back as it found it.

Before the first step a run writes ``config.yml``, ``optimizations.json``, ``metrics.jsonl``
and ``tensorboard/`` (and the directories above them); if it then stops (bad data, a model
that does not load, a bug), those half-written files would make the next run into the same
directory think another run lives there. :class:`StartGuard` records what the run directory
held before the start and, on any exception before the first step, removes what is new and
restores the small files the start overwrote (``config.yml`` of a run being resumed). It also
turns an unexpected exception (not a :class:`HoneError`) into one paragraph carrying the
exception's own message and a hint to rerun with ``--verbose`` for the traceback.

:meth:`StartGuard.watch` also takes the run directory's lock (:mod:`hone.train.run_lock`) before
it records anything, and the guard holds it until the run ends: a run refused because another
one holds the directory never undoes that run's files, and the undo of a failed start finishes
before another run can take the directory.

Outside the run directory the start writes only the prepared-data cache, whose entries are
published atomically and complete (see :mod:`hone.data.cache`); a valid entry is kept, so the
next start does not tokenize again.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from hone.atomic import atomic_write_bytes
from hone.errors import HoneError
from hone.train.run_lock import RunLock

#: Files up to this size that existed before the start are kept in memory and written back if
#: the start changed them; larger ones (metrics of a long run) are left as they are.
RESTORE_MAX_BYTES = 1 << 20
RESTORE_TOTAL_BYTES = 32 << 20
#: Past this many entries the run directory is not a run directory: only its top level is tracked.
MAX_TRACKED = 50_000


class StartFailed(HoneError):
    """An unexpected exception stopped ``hone train`` before its first optimizer step."""


class StartGuard:
    """``with StartGuard() as guard: guard.watch(out); run(step_callback=guard.on_step)``."""

    def __init__(self) -> None:
        self.started = False
        self._root: Path | None = None
        self._created_top: Path | None = None
        self._before: set[str] = set()
        self._saved: dict[str, bytes] = {}
        self._shallow = False
        self._lock: RunLock | None = None

    # ---------------------------------------------------------------- recording

    def watch(self, output_dir: Path, lock: bool = True) -> None:
        """Take ``output_dir``'s run lock (``lock``; see :mod:`hone.train.run_lock`; held until the
        guard exits) and record what the directory holds now (call before anything writes into it)."""
        root = Path(output_dir).absolute()
        top = None
        if not root.exists():
            top = root
            while not top.parent.exists() and top.parent != top:
                top = top.parent
        if lock and (top is not None or root.is_dir()):  # a file there: the run's own checks say so
            self._lock = RunLock(root, note=lambda m: print(m, file=sys.stderr)).acquire()
        self._root = root
        if top is not None:
            self._created_top = top
            return
        if not root.is_dir():
            return
        budget = RESTORE_TOTAL_BYTES
        for rel, is_file in self._walk(root):
            self._before.add(rel)
            if len(self._before) > MAX_TRACKED:
                self._shallow = True
                self._before = {entry.name for entry in root.iterdir()}
                return
            if is_file:
                path = root / rel
                try:
                    size = path.stat().st_size
                    if size <= RESTORE_MAX_BYTES and size <= budget:
                        self._saved[rel] = path.read_bytes()
                        budget -= size
                except OSError:
                    pass

    def on_step(self, *_: Any) -> None:
        """A step callback: the run has started, its outputs are now the user's."""
        self.started = True

    # ---------------------------------------------------------------- undoing

    def undo(self) -> None:
        """Remove what the start created in the run directory; restore what it overwrote."""
        if self._root is None:
            return
        if self._created_top is not None:
            if self._created_top.is_dir() and not self._created_top.is_symlink():
                shutil.rmtree(self._created_top, ignore_errors=True)
            return
        if not self._root.is_dir():
            return
        if self._shallow:
            for entry in list(self._root.iterdir()):
                if entry.name not in self._before:
                    _remove(entry)
            return
        for dirpath, dirnames, filenames in os.walk(self._root, followlinks=False):
            base = Path(dirpath)
            for name in list(dirnames):
                rel = (base / name).relative_to(self._root).as_posix()
                if rel not in self._before:
                    _remove(base / name)
                    dirnames.remove(name)
            for name in filenames:
                rel = (base / name).relative_to(self._root).as_posix()
                if rel not in self._before:
                    _remove(base / name)
        for rel, content in self._saved.items():
            path = self._root / rel
            try:
                if not path.is_file() or path.read_bytes() != content:
                    atomic_write_bytes(path, content)
            except OSError:
                pass

    # ---------------------------------------------------------------- the context

    def __enter__(self) -> StartGuard:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        try:
            return self._exit(exc)
        finally:
            if self._lock is not None:  # after the undo: no other run may start in a half-undone directory
                self._lock.release()

    def _exit(self, exc: BaseException | None) -> bool:
        if exc is None or self.started:
            return False
        self.undo()
        if isinstance(exc, Exception) and not isinstance(exc, HoneError):
            message = str(exc).strip() or "(no message)"
            raise StartFailed(
                f"hone train stopped before its first optimizer step: {type(exc).__name__}: {message}. "
                "Nothing was left in training.output_dir; rerun with --verbose to see the traceback"
            ) from exc
        return False  # HoneError, KeyboardInterrupt, SystemExit: on their way, files undone

    @staticmethod
    def _walk(root: Path):
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            base = Path(dirpath)
            for name in dirnames:
                yield (base / name).relative_to(root).as_posix(), False
            for name in filenames:
                yield (base / name).relative_to(root).as_posix(), True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass
