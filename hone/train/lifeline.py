"""A rank of a multi-process run dies with its launcher.

``hone train CFG --nproc-per-node N`` becomes ``torchrun``, which starts every rank in a session
of its own. When the launcher dies without stopping its ranks (SIGKILL, the out-of-memory
killer, a crash), the ranks would be adopted by init and keep training: a later
``training.resume: latest`` would race them on the same run directory, and they would write
``final/`` of a run the user believes stopped. So each rank ties its life to its parent:

- on Linux, the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``): the rank is
  killed the moment its parent exits. Set, then checked: if the parent is already not the
  launcher (it died between the rank's start and the ``prctl``), the rank stops at once;
- elsewhere, a daemon thread that looks at the parent's pid every second and kills the rank
  when it changes.

SIGKILL, not SIGTERM: a graceful stop would save a checkpoint with collectives that the other
ranks, dying the same way, cannot answer. What the run keeps is its newest complete checkpoint
(checkpoints are written whole or not at all); continue it with ``training.resume: latest``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from hone.errors import HoneError

#: Set by ``hone train --nproc-per-node`` before it becomes torchrun (same pid): the ranks' parent.
LAUNCHER_PID_ENV = "HONE_LAUNCHER_PID"

#: ``PR_SET_PDEATHSIG`` from ``<linux/prctl.h>``.
PR_SET_PDEATHSIG = 1


class LauncherGone(HoneError):
    """The launcher of this rank died before the rank could tie itself to it."""


def launcher_pid() -> int:
    """The pid this rank's parent must have: the one the launcher recorded, else the parent now
    (a plain ``torchrun -m hone train``)."""
    recorded = os.environ.get(LAUNCHER_PID_ENV, "")
    return int(recorded) if recorded.isdigit() else os.getppid()


def die_with_launcher(parent: int | None = None, watchdog_only: bool = False) -> str:
    """Make this process die when ``parent`` (default :func:`launcher_pid`) dies. Returns how:
    ``"pdeathsig"`` or ``"watchdog"`` (``watchdog_only``: the other systems' way, on any system).
    Raises :class:`LauncherGone` if the parent is already gone."""
    parent = launcher_pid() if parent is None else parent
    how = "pdeathsig" if not watchdog_only and _set_parent_death_signal() else "watchdog"
    if os.getppid() != parent:  # died before the signal was armed: nobody would send it
        raise LauncherGone(f"the launcher of this rank (pid {parent}) is gone (the parent is now pid {os.getppid()}): stopping")
    if how == "watchdog":
        threading.Thread(target=_watch, args=(parent, 1.0), name="hone-lifeline", daemon=True).start()
    return how


def _set_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int, interval_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(interval_s)
    os.kill(os.getpid(), signal.SIGKILL)
