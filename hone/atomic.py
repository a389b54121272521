"""Write files and directories so that a reader (or a resumed run) never sees half of one.

Everything goes to a temporary name in the same directory, is flushed and fsync'd, then
renamed over the target: ``os.replace`` is atomic on POSIX within one filesystem, so a crash
leaves either the old file or the new one, never a truncated mix. One module for the whole
package: configs, metrics, plots, the data cache, final models and merges all write this way.
A write that fails (disk full, read-only) raises :class:`~hone.errors.WriteError`, which names
the target and says that its earlier version is unchanged (it is also an ``OSError``).

**File modes follow the umask.** Some writers create private files whatever the umask says
(``safetensors`` writes ``0600``, as ``mkstemp`` does); a published file gets the mode any new
file of the user gets (``0644`` under the usual umask ``022``), so a model shared on a cluster
or copied by another account can be read like the config and metrics beside it.
"""

import errno
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hone.errors import WriteError


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries (a rename is only durable once its
    directory is synced), to disk; filesystems that refuse are left as they are."""
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


def current_umask() -> int:
    """The process's umask, read without changing it where Linux allows (``/proc``): swapping it
    with ``os.umask`` would, for an instant, give other threads' new files the wrong mode."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal_file_mode(path: Path, umask: int | None = None) -> None:
    """Give the file ``path`` the mode a new file gets under the umask (``0666 & ~umask``, the
    execute bits it had kept): undoes the ``0600`` of writers that create private files."""
    mask = current_umask() if umask is None else umask
    try:
        mode = os.stat(path).st_mode & 0o7777
        wanted = (0o666 | (mode & 0o111)) & ~mask
        if mode != wanted:
            os.chmod(path, wanted)
    except OSError:  # a filesystem without modes: leave it as written
        pass


def normal_dir_mode(path: Path, umask: int | None = None) -> None:
    """Give the directory ``path`` the mode ``mkdir`` gives under the umask (``0777 & ~umask``):
    ``tempfile.mkdtemp`` makes its directories ``0700``, which would keep a published cache
    private to its writer on a shared machine."""
    mask = current_umask() if umask is None else umask
    try:
        os.chmod(path, 0o777 & ~mask)
    except OSError:  # a filesystem without modes: leave it as made
        pass


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
        target.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        normal_file_mode(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # its directory could not be made: there is no temp file
            pass
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise write_error(target, exc) from exc
        raise
    fsync_path(target.parent)


def write_error(target: Path, exc: OSError) -> WriteError:
    """A user-facing :class:`WriteError` for a failed atomic write of ``target``."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    hint = "free some space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "check the permissions and the disk"
    return WriteError(
        f"cannot write '{target}' ({reason}); nothing half-written was left, and an earlier "
        f"'{Path(target).name}' there, if any, is unchanged: {hint} and run again",
        exc.errno,
    )


def atomic_write_bytes(target: Path, data: bytes) -> None:
    atomic_write_with(Path(target), lambda tmp: tmp.write_bytes(data))


def atomic_write_text(target: Path, text: str) -> None:
    atomic_write_bytes(Path(target), text.encode("utf-8"))


def fsync_tree(root: Path) -> None:
    """Make every file below ``root`` durable (with the umask's mode, see the module's docstring)
    before a rename publishes the directory."""
    umask = current_umask()
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            normal_file_mode(path, umask)
            fsync_path(path)
    fsync_path(root)


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``final``; on success it becomes ``final``.

    A directory cannot be renamed over a non-empty one, so an existing ``final`` is first moved
    aside, the new one renamed in, and only then the old one deleted. The window between the
    two renames is two syscalls; the old output is removed only once the new one is in place.
    On any error the temporary directory is removed and ``final`` is left as it was.
    """
    final = Path(final)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = final.with_name(f".{final.name}.tmp-{tag}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:
        raise write_error(final, exc) from exc
    try:
        yield tmp
        fsync_tree(tmp)
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{tag}")
            final.rename(old)
        try:
            tmp.rename(final)
        except BaseException:
            if old is not None:
                old.rename(final)
            raise
        fsync_path(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise write_error(final, exc) from exc
        raise
