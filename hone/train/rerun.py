"""Running into a run directory again: what it holds, clearing it on request, and what to say.

A run directory that holds a run is never trained into afresh by accident. The three ways on,
and when each is offered:

- ``training.resume: latest`` continues from the newest checkpoint: offered for an unfinished
  run with a checkpoint, and for a finished one only when ``training.max_steps`` now asks for
  more steps than it ran (otherwise resuming it trains nothing);
- ``hone train --overwrite`` (``training.overwrite_output_dir: true``) starts over in it;
- another ``training.output_dir``.

**Overwriting is refused outside a run directory.** :func:`clear_run_dir` removes only what
``hone train`` writes (the names of :mod:`hone.run_files`, the hidden leftovers of atomic
writes) and only when the directory holds nothing else: a mistyped ``output_dir`` pointing at a
project or a home directory is named and left alone, never emptied.
"""

import fcntl
import os
import re
import shutil
from pathlib import Path

from hone.errors import HoneError
from hone.run_files import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    FINAL_DIR,
    METRICS_FILE,
    OPTIMIZATIONS_FILE,
    PLOT_FILE,
    REFERENCE_FILE,
    TENSORBOARD_DIR,
)
from hone.train.checkpoint_layout import list_checkpoints

#: What a started run leaves behind (config.yml alone is not enough: a run that failed while
#: loading its data or model wrote it and left nothing else worth protecting).
RUN_MARKERS = (METRICS_FILE, CHECKPOINTS_DIR, FINAL_DIR)
#: Everything ``hone train`` writes at the top of its run directory.
RUN_FILES = frozenset(
    (CONFIG_FILE, METRICS_FILE, CHECKPOINTS_DIR, FINAL_DIR, PLOT_FILE, TENSORBOARD_DIR, OPTIMIZATIONS_FILE, REFERENCE_FILE)
)
#: Hidden leftovers of an interrupted atomic write (``.config.yml.tmp-<pid>``, ``.final.old-<tag>``).
_LEFTOVER = re.compile(r"^\.[^/]+\.(tmp|old)-[0-9A-Za-z-]+$")
#: A hidden lock file (the run directory's lock, ``.hone.lock``): kept by an overwrite, never
#: removed, and an overwrite is refused while another process holds it.
_LOCK = re.compile(r"^\.[^/]+\.lock$")

OVERWRITE_HINT = "--overwrite (training.overwrite_output_dir: true)"


class OutputDirInUse(HoneError):
    """``training.output_dir`` holds another run and the config does not ask to resume it."""


class NotARunDir(HoneError):
    """``training.overwrite_output_dir`` on a directory that holds files ``hone train`` did not write."""


def run_markers(out: Path) -> list[str]:
    """The markers of a started run that ``out`` holds."""
    return [name for name in RUN_MARKERS if (out / name).exists()]


def is_run_entry(name: str) -> bool:
    return name in RUN_FILES or bool(_LEFTOVER.match(name)) or bool(_LOCK.match(name))


def held_by_another(lock: Path) -> bool:
    """Whether another process holds an exclusive ``flock`` on ``lock`` (a run that still lives)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # a file system without flock: nothing to tell
        return False
    finally:
        os.close(fd)  # drops the test lock, if taken
    return False


def clear_run_dir(out: Path) -> list[str]:
    """Remove the earlier run in ``out`` (for ``training.overwrite_output_dir``); the names
    removed. Nothing is removed unless every entry is one ``hone train`` writes, nor while another
    process holds the directory's lock file (which is kept: a stale one is taken over by the run)."""
    out = Path(out)
    if not out.is_dir():
        return []
    entries = sorted(entry.name for entry in out.iterdir())
    foreign = [name for name in entries if not is_run_entry(name)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise NotARunDir(
            f"training.overwrite_output_dir: '{out}' does not look like a hone run directory: it holds {shown}, "
            "which hone train does not write. Nothing was removed: pick another training.output_dir, or empty "
            "that directory yourself"
        )
    removed = [name for name in entries if not _LOCK.match(name)]  # a lock is its holder's business
    if not removed:
        return []
    held = [name for name in entries if _LOCK.match(name) and held_by_another(out / name)]
    if held:
        raise OutputDirInUse(
            f"training.overwrite_output_dir: '{out}' is in use: another process holds its {held[0]}. "
            "Nothing was removed: stop that run first, or pick another training.output_dir"
        )
    for name in removed:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return removed


def in_use_message(out: Path, found: list[str], max_steps: int | None) -> str:
    """Why ``out`` is refused without resume or overwrite, and the ways on that do something."""
    checkpoints = list_checkpoints(out)
    last = checkpoints[-1][0] if checkpoints else None
    if FINAL_DIR in found:
        state = "a finished run"
        ways = [f"start over in it with {OVERWRITE_HINT}", "pick another training.output_dir"]
        if last is not None and max_steps is not None and max_steps > last:
            ways.append(f"train it on from step {last} to {max_steps} with training.resume: latest")
    elif last is not None:
        state = f"an unfinished run (last checkpoint: step {last})"
        ways = [
            "continue it with training.resume: latest (--set training.resume=latest)",
            f"start over in it with {OVERWRITE_HINT}",
            "pick another training.output_dir",
        ]
    else:
        state = "a run that stopped before its first checkpoint"
        ways = [f"start over in it with {OVERWRITE_HINT}", "pick another training.output_dir"]
    return f"training.output_dir '{out}' already holds {state} ({', '.join(found)}): " + "; or ".join(ways)


def stopped_now_message(out: Path, step: int | None, started: bool) -> str:
    """What a run stopped at once (a second Ctrl-C) left: the checkpoint to continue from, or
    that there is none and how to start over."""
    stopped = f"Stopped during step {step} (Ctrl-C); that step was not finished." if step else "Stopped (Ctrl-C)."
    checkpoints = list_checkpoints(out)
    if checkpoints:
        last, path = checkpoints[-1]
        return (
            f"{stopped} Saved: checkpoint step {last} at {path}. "
            f"To continue from it, run the same command with --set training.resume=latest; to start over, add --overwrite."
        )
    if not started:
        return (
            "Stopped (Ctrl-C) before the first optimizer step: nothing was saved and training.output_dir was left as "
            "it was; run the same command to start again."
        )
    return (
        f"{stopped} Nothing was saved: the run had written no checkpoint yet (training.save_steps "
        "sets how often it does). To start over, run the same command with --overwrite."
    )
