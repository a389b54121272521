"""Write files so that a reader (or a resumed run) never sees half of one.

Everything goes to a temporary name in the same directory, is flushed and fsync'd, then
renamed over the target: ``os.replace`` is atomic on POSIX within one filesystem, so a crash
leaves either the old file or the new one, never a truncated mix.
"""

import os
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (a rename is only durable once its directory is synced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not let a directory be opened; nothing more to do
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_name(target: Path) -> Path:
    """A hidden sibling of ``target``: same filesystem, never mistaken for the real file."""
    return target.with_name(f".{target.name}.tmp-{os.getpid()}")


def atomic_write_with(target: Path, write: Callable[[Path], None]) -> None:
    """Let ``write`` fill a temp file, then fsync it and rename it onto ``target``.

    For writers that insist on a path of their own (matplotlib, ``safetensors``, ``torch.save``).
    """
    target = Path(target)
    tmp = temp_name(target)
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def atomic_write_bytes(target: Path, data: bytes) -> None:
    atomic_write_with(Path(target), lambda tmp: tmp.write_bytes(data))


def atomic_write_text(target: Path, text: str) -> None:
    atomic_write_bytes(Path(target), text.encode("utf-8"))
