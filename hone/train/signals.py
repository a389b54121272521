"""Stop cleanly on Ctrl-C or SIGTERM (preemption, ``kill``, a job scheduler's time limit).

While the loop runs, SIGINT and SIGTERM only set a flag; the loop finishes the optimizer step
in progress, saves a checkpoint and returns. A second Ctrl-C means "now": it raises
``KeyboardInterrupt`` at once. The previous handlers are put back when the loop ends, so
hone leaves the host program (a notebook, a test runner) as it found it.
"""

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StopRequest:
    """Set by a signal; read by the loop after each optimizer step."""

    signal_name: str | None = None
    _count: int = field(default=0, repr=False)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def request(self, name: str) -> None:
        self.signal_name = name


@contextmanager
def graceful_stop() -> Iterator[StopRequest]:
    """Route SIGINT/SIGTERM to a :class:`StopRequest` for the duration of the block."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        yield stop
        return

    def handle(signum: int, frame) -> None:  # noqa: ARG001 (signal handler signature)
        stop._count += 1
        if signum == signal.SIGINT and stop._count > 1:
            raise KeyboardInterrupt
        stop.request(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
