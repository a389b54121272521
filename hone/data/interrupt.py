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
waited forever (``_handle``). The interrupt is then delivered again once the fork is over
(:func:`_fork_ends`): with ``num_proc`` the parent runs no batch of its own, so the flag alone
let the workers tokenize everything before the build stopped. A worker starts with the flag
clear (:func:`_worker_starts`); its parent stops the pool.
"""

from __future__ import annotations

import logging  # noqa: F401 - its at-fork hooks registered before ours (see _fork_starts)
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
#: A SIGINT arrived while forking: it is delivered again once the fork is over.
_deferred = False
#: The interrupt has been raised as ``KeyboardInterrupt`` (a deferred one needs no second raise).
_raised = False
#: How long after a fork the deferred SIGINT is raised again: long enough for the main thread to
#: have left every at-fork hook (a hook registered after ours would swallow a raise inside it).
REDELIVER_AFTER_S = 0.05


def _fork_starts() -> None:
    global _forking
    _forking = True


def _fork_ends() -> None:
    """In the parent after a fork: a SIGINT that arrived during it is raised again shortly, from a
    timer thread (Python runs the handler in the main thread, outside the at-fork hooks by then;
    should it land in another fork's window it is deferred again)."""
    global _forking, _deferred
    _forking = False
    if _deferred:
        _deferred = False
        timer = threading.Timer(REDELIVER_AFTER_S, _redeliver)
        timer.daemon = True
        timer.start()


def _redeliver() -> None:
    """Raise SIGINT again unless the interrupt has reached the main thread meanwhile (a check
    after the fork raised it) or the preparation is over (its handler is no longer ours)."""
    if not _raised and signal.getsignal(signal.SIGINT) is _handle:
        signal.raise_signal(signal.SIGINT)


def _worker_starts() -> None:
    """A forked worker starts without its parent's interrupt: a SIGINT that reached the parent
    while it forked set the flag before the child's copy was taken, and the worker then raised
    ``KeyboardInterrupt`` at its first batch and printed a traceback. The parent stops the pool."""
    global _forking, _interrupted, _deferred, _raised
    _forking = _interrupted = _deferred = _raised = False


# Registered after logging's (imported above by the standard library): "before" hooks run in
# reverse order of registration and "after" hooks in order, so this window holds logging's
# lock-taking and lock-releasing hooks.
os.register_at_fork(before=_fork_starts, after_in_parent=_fork_ends, after_in_child=_worker_starts)


def _handle(signum: int, frame) -> None:  # noqa: ARG001 (signal handler signature)
    """Set the flag; raise ``KeyboardInterrupt`` at once unless the process is forking. Raised
    inside an at-fork hook (logging's releases its module lock after ``datasets`` forks a
    worker), the interrupt would leave that lock held and the next log line would wait forever:
    ``hone preprocess`` with ``num_proc`` then hung after Ctrl-C. There the interrupt is
    deferred until the fork is over (:func:`_fork_ends`)."""
    global _interrupted, _deferred, _raised
    _interrupted = True
    if _forking:
        _deferred = True
        return
    _raised = True
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
    ``KeyboardInterrupt`` it raised then was swallowed on the way."""
    global _raised
    if _interrupted:
        _raised = True
        raise KeyboardInterrupt


@contextmanager
def interruptible() -> Iterator[None]:
    """Route SIGINT through the flag for the duration of the block (main thread only)."""
    global _interrupted, _deferred, _raised
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield
        return
    _interrupted = _deferred = _raised = False
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
        _interrupted = _deferred = _raised = False
