"""Ctrl-C while data is prepared: stop at once, publish nothing.

Python raises ``KeyboardInterrupt`` wherever the main thread is when SIGINT arrives, and the
libraries that read, tokenize and write the data do not always let it through:

- ``datasets``' multi-process ``map`` (``data.num_proc``) replaces it with a ``TimeoutError``
  while it collects its workers' results (``iflatmap_unordered``'s ``finally``), so the
  command died with a traceback and exit 1;
- ``datasets``' fingerprinting hashes a transform's arguments under a bare ``except:``
  (``update_fingerprint``), and an exception raised inside a finalizer (``__del__``) is
  printed and dropped: an interrupt landing there is lost, and the preparation ran to its end
  and published the cache entry (exit 0). (One such place: logging's at-fork hook, run while
  ``datasets`` forks its workers.)

So while data is prepared, SIGINT also sets a flag (and still raises ``KeyboardInterrupt`` at
once, as Python's own handler does): the encoder checks it before each batch and the build
before it publishes, so an interrupt that a library swallowed stops the run a batch later,
and an exception seen after the flag was set is reported as the interrupt it replaced. The
previous handler is put back afterwards (training installs its own around the loop). A
process that ignores SIGINT (started in the background with ``nohup``) keeps ignoring it.
While the process forks (``datasets`` starting its workers), SIGINT only sets the flag: raised
inside logging's at-fork hook, the interrupt left logging's lock held, and the next log line
waited forever (``_handle``).

While forked workers do the work (``data.num_proc``: :func:`workers_run`), the first SIGINT does
not raise in the parent at all. Raised there, at whatever point the parent was in
``multiprocess``'s pool machinery, it could leave ``Pool.terminate`` waiting forever on a lock
(seen: its task-handler thread blocked on the queue's write lock, ``hone preprocess`` never
exiting). Instead the parent sets one byte of memory it shares with the workers, each worker's
encoder raises :class:`WorkersStopped` at its next batch, the pool hands those back as the tasks'
failures (the way any error in a worker ends a map), and the parent reports the interrupt. A
second SIGINT raises at once.
"""

from __future__ import annotations

import logging  # noqa: F401 - its at-fork hooks registered before ours (see _fork_starts)
import mmap
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Set by SIGINT while :func:`interruptible` is active; per process (a forked worker starts with it clear).
_interrupted = False
#: True from just before this process forks until every other at-fork hook has run after it.
_forking = False
#: True in the main process while forked workers do the work (:func:`workers_run`).
_pooled = False
#: The process that runs :func:`interruptible` (a forked worker inherits the number, not the role).
_main_pid: int | None = None
#: One byte shared with every process forked after this module was imported (an anonymous
#: shared mapping): 1 once the main process was interrupted while its workers ran.
_stop_workers = mmap.mmap(-1, 1)


class WorkersStopped(Exception):
    """Raised in a forked worker whose parent was interrupted. An ``Exception``, not a
    ``KeyboardInterrupt``: the pool hands it back to the parent as the task's failure, where a
    ``KeyboardInterrupt`` would kill the worker and print its traceback."""


def _fork_starts() -> None:
    global _forking
    _forking = True


def _fork_ends() -> None:
    global _forking
    _forking = False


def _worker_starts() -> None:
    """A forked worker starts without its parent's flag: it is not the process that was
    interrupted (a SIGINT during the fork set the flag before the child's copy was taken, and
    the worker raised ``KeyboardInterrupt`` at its first batch, printing a traceback). It learns
    of its parent's interrupt from the shared byte (:func:`check_interrupted`)."""
    global _forking, _interrupted, _pooled
    _forking = _interrupted = _pooled = False


# Registered after logging's (imported above by the standard library): "before" hooks run in
# reverse order of registration and "after" hooks in order, so this window holds logging's
# lock-taking and lock-releasing hooks.
os.register_at_fork(before=_fork_starts, after_in_parent=_fork_ends, after_in_child=_worker_starts)


def _in_forked_worker() -> bool:
    """Whether this process was forked by the one running :func:`interruptible`."""
    return _main_pid is not None and os.getpid() != _main_pid


def _handle(signum: int, frame) -> None:  # noqa: ARG001 (signal handler signature)
    """Set the flag; raise ``KeyboardInterrupt`` at once, except:

    - while forked workers do the work, the first SIGINT stops them through the shared byte and
      raises nothing in the parent (:func:`workers_run`: why);
    - while the process forks, it raises nothing: raised inside an at-fork hook (logging's
      releases its module lock after ``datasets`` forks a worker), the interrupt left that lock
      held and the next log line waited forever. The flag stops the build at its next check;
    - in a forked worker (which inherits this handler) it does nothing: a terminal's Ctrl-C
      reaches the whole process group, and raised there it killed each worker mid-batch with a
      traceback. The parent got the same SIGINT and stops the workers through the shared byte."""
    global _interrupted
    if _in_forked_worker():
        return
    first = not _interrupted
    _interrupted = True
    if _pooled and first:
        _stop_workers[0] = 1
        return
    if not _forking:
        raise KeyboardInterrupt


def _quiet_unraisable(previous):
    """A ``sys.unraisablehook`` that drops the ``KeyboardInterrupt`` our handler raised where
    Python cannot raise it (a finalizer, an at-fork hook such as logging's ``_releaseLock``
    while ``datasets`` forks its workers): Python would print it as "Exception ignored in ..."
    with a traceback, yet the flag already stops the build a batch later."""

    def hook(unraisable) -> None:
        if _interrupted and isinstance(unraisable.exc_value, KeyboardInterrupt):
            return
        previous(unraisable)

    return hook


def check_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` if SIGINT arrived during the preparation, even if the
    ``KeyboardInterrupt`` it raised then was swallowed on the way; in a forked worker, raise
    :class:`WorkersStopped` if its parent was interrupted."""
    if _in_forked_worker():
        if _stop_workers[0]:
            raise WorkersStopped("stopped: the process that started this worker was interrupted")
        return
    if _interrupted:
        raise KeyboardInterrupt


@contextmanager
def workers_run(active: bool = True) -> Iterator[None]:
    """The block waits on forked workers (``datasets``' ``map`` with ``num_proc``): the first
    SIGINT stops the workers at their next batch instead of raising in the main process (see
    the module's docstring for why), and the block's end raises the interrupt. ``active=False``
    (no workers, or outside :func:`interruptible`) changes nothing."""
    global _pooled
    if not active or _main_pid != os.getpid() or signal.getsignal(signal.SIGINT) is not _handle:
        yield
        return
    _pooled = True
    try:
        yield
    finally:
        _pooled = False
    check_interrupted()


@contextmanager
def interruptible() -> Iterator[None]:
    """Route SIGINT through the flag for the duration of the block (main thread only)."""
    global _interrupted, _main_pid
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield
        return
    _interrupted = False
    _main_pid = os.getpid()
    _stop_workers[0] = 0
    signal.signal(signal.SIGINT, _handle)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _quiet_unraisable(previous_hook)
    try:
        yield
        check_interrupted()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        if _interrupted:  # e.g. datasets' TimeoutError that replaced the KeyboardInterrupt
            raise KeyboardInterrupt from exc
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
        _interrupted = False
        _main_pid = None
        _stop_workers[0] = 0
