"""Can hone write where the config says, and read what it names? Checked before any work.

A run that finds out its ``output_dir`` is a file (or read-only, or on a full disk) only when it
saves its first checkpoint has wasted the data preparation and the model load. These checks run
first: :func:`output_dir_problem` is static (nothing is created; ``hone validate`` uses it),
:func:`ensure_writable_dir` creates the directory and proves it writable by writing and
removing a probe file, which is the only test that holds for every user (``os.access`` says
yes to root on a read-only bind mount, and yes to everyone on a full disk).
"""

from __future__ import annotations

import errno as errno_codes
import os
import shutil
from pathlib import Path

from hone.errors import WriteError

#: The least free space a run directory's file system must have at the start: enough for the
#: config, metrics and a LoRA checkpoint of a small model. Not a promise that the whole run
#: fits (that depends on checkpoints hone cannot size yet), but it catches the full disk.
MIN_FREE_BYTES = 64 << 20

PROBE_NAME = ".hone-write-probe"


def nearest_existing(path: Path) -> Path:
    """``path`` itself if it exists, else its closest existing ancestor."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def output_dir_problem(path: Path, key: str = "training.output_dir") -> str | None:
    """Why ``path`` cannot become a directory hone writes into, or None; creates nothing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"'{path}' is a file, not a directory: pick another {key} (or move the file away)"
    anchor = nearest_existing(path)
    if not anchor.is_dir():
        return f"'{path}' lies under '{anchor}', which is a file, so the directory cannot be created: pick another {key}"
    if not os.access(anchor, os.W_OK | os.X_OK):
        what = "directory" if anchor == path.absolute() else f"directory '{anchor}' it would be created in"
        return f"'{path}': the {what} is not writable for this user: pick another {key}, or fix its permissions"
    return free_space_problem(anchor, path, key)


def free_space_problem(anchor: Path, path: Path, key: str) -> str | None:
    """A message when the file system of ``anchor`` has less than :data:`MIN_FREE_BYTES` free."""
    try:
        free = shutil.disk_usage(anchor).free
    except OSError:
        return None  # cannot tell: the write probe or the first write will say
    if free < MIN_FREE_BYTES:
        return (
            f"'{path}': its file system has only {_mib(free)} free; hone needs at least "
            f"{_mib(MIN_FREE_BYTES)} to start a run there: free some space or pick another {key}"
        )
    return None


def ensure_writable_dir(path: Path, key: str = "training.output_dir") -> None:
    """Create ``path`` (with parents) and prove it writable; raise :class:`WriteError` if not.

    A directory this creates is left in place on success; on failure nothing new is left.
    """
    path = Path(path)
    problem = output_dir_problem(path, key)
    if problem is not None:
        raise WriteError(f"{key}: {problem}")
    anchor = nearest_existing(path)
    created = None if path.is_dir() else _topmost_missing(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f"{PROBE_NAME}-{os.getpid()}"
        with open(probe, "wb") as handle:
            handle.write(b"hone")
            handle.flush()
            os.fsync(handle.fileno())
        probe.unlink()
    except OSError as exc:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        reason = exc.strerror or str(exc)
        hint = "free some space" if exc.errno in (errno_codes.ENOSPC, errno_codes.EDQUOT) else "fix its permissions"
        raise WriteError(
            f"{key}: cannot write into '{path}' ({reason}; checked under '{anchor}'): pick another {key}, or {hint}",
            exc.errno,
        ) from exc


def readable_file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as a data file, or None (opens it and reads one byte)."""
    path = Path(path)
    if not path.exists():
        return None  # the caller's "not found" message is more precise
    if path.is_dir():
        return f"'{path}' is a directory; point it at one data file"
    if not path.is_file():
        return f"'{path}' is not a regular file"
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as exc:
        return f"cannot read '{path}': {exc.strerror or exc}"
    return None


def _topmost_missing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.parent.exists() and path.parent != path:
        path = path.parent
    return path


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.0f} MiB"
