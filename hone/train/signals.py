"""Stop cleanly on Ctrl-C or SIGTERM (preemption, ``kill``, a job scheduler's time limit).

While the loop runs, SIGINT and SIGTERM only set a flag; the loop finishes the optimizer step
in progress, saves a checkpoint and returns. The first signal is answered at once with one
line on stderr saying so (with a 30 s step, a silent terminal gets pressed again). A second
Ctrl-C means "now": it raises :class:`StopNow` (a ``KeyboardInterrupt``) at once, without
finishing the step; ``hone train`` then says what the run directory holds (the last checkpoint,
or nothing to resume). The previous handlers are put back when the loop ends, so hone leaves the
host program (a notebook, a test runner) as it found it.

The line is written with one ``os.write`` to file descriptor 2, not through ``print`` or the
rich console: the handler runs between two bytecodes of whatever the main thread was doing,
possibly inside a ``print`` to the same stream, and a buffered text stream is not reentrant.
It starts and ends with a newline: the line of a live progress bar is left as it was, and the
bar's next refresh (which clears only its own, current line) draws below the message.
"""

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


class StopNow(KeyboardInterrupt):
    """A second Ctrl-C: the run stops at once, in the middle of step :attr:`step`."""

    def __init__(self, step: int):
        super().__init__(f"stopped during step {step}")
        self.step = step


@dataclass
class StopRequest:
    """Set by a signal; read by the loop after each optimizer step."""

    signal_name: str | None = None
    step: int = 1
    """The step a signal arriving now stops after (the step in progress; see :meth:`after_step`)."""
    promised: int = 0
    """The step the first signal said the run stops after."""
    announce: bool = True
    """Whether this process says what a signal will do (rank 0 of several: one line, not N)."""
    _count: int = field(default=0, repr=False)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def request(self, name: str) -> None:
        self.signal_name = name

    def after_step(self, step: int) -> bool:
        """Whether the run stops now that ``step`` is done: a signal that came while it ran. A
        signal arriving from here on is one for step ``step + 1``, and is answered so.

        The handler runs whole between two bytecodes of this method: before the assignment, it
        promised ``step`` (and the test sees it); after it, ``step + 1`` (and the test waits for
        that step). So the run stops after exactly the step the line named."""
        self.step = step + 1
        return self.requested and self.promised <= step


def first_signal_line(name: str, step: int) -> str:
    """What the first SIGINT/SIGTERM will do, said when it arrives."""
    who = "Ctrl-C" if name == "SIGINT" else name
    line = f"{who}: stopping after step {step} finishes; a checkpoint will be saved."
    if name == "SIGINT":
        line += " Press Ctrl-C again to stop now without finishing the step."
    return line


def say_now(line: str) -> None:
    """Write ``line`` to stderr with one system call (safe inside a signal handler)."""
    try:
        os.write(2, f"\n{line}\n".encode())
    except OSError:  # no stderr (closed, a broken pipe): the stop goes on without the line
        pass


@contextmanager
def graceful_stop(announce: bool = True) -> Iterator[StopRequest]:
    """Route SIGINT/SIGTERM to a :class:`StopRequest` for the duration of the block."""
    stop = StopRequest(announce=announce)
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        yield stop
        return

    def handle(signum: int, frame) -> None:  # noqa: ARG001 (signal handler signature)
        stop._count += 1
        if signum == signal.SIGINT and stop._count > 1:
            raise StopNow(stop.step)
        name = signal.Signals(signum).name
        if not stop.requested:
            stop.promised = stop.step
            if stop.announce:
                say_now(first_signal_line(name, stop.step))
        stop.request(name)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
