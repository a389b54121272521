"""``python -m hone.train.torchrun ARGS``: torchrun whose failure ends in one line, not its traceback.

``hone train CFG --nproc-per-node N`` becomes this module (same pid, by ``execv``), which runs
torchrun's own launcher (``torch.distributed.run``: its argument parser and ``run``) unchanged:
the same rendezvous, the same environment for the ranks, the same signal forwarding. What differs
is the ending. Called as ``torchrun``, a failed rank ends the launch in a ~35-line Python
traceback of ``ChildFailedError`` and a failure table, printed after the rank's own one-line
``error: [rank N] ...``, so the cause (a config key, an expert-capacity overflow) scrolls out of
view. Here the failure is answered with one line naming the rank that failed first, how it ended
(an exit code, or a signal: then nothing of hone's reported it, and the line says what usually
sends that signal), and that its error is above; the launch exits with that rank's code (128 +
the signal's number for a signal, the shell's convention), where torchrun exits 1 for every
failure. A signal to the launcher itself (``kill PID``, Ctrl-C) reaches the ranks as under
torchrun (its agent passes it on and waits up to 30 s before SIGKILL): each finishes its step
and saves a checkpoint (hone.train.signals), and the launch exits 128 + the signal's number,
where torchrun ended in a traceback of its ``SignalException`` and exit status 1.

``torchrun -m hone train CFG`` (several hosts, or torchrun's own options) is torchrun as it is.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence


def failure_line(first_rank: int, exitcode: int, failed_ranks: Sequence[int]) -> str:
    """The launch's last line: which rank failed first and how; ``failed_ranks`` is every rank that
    ended with a failure (the others stop because the first one did)."""
    others = sorted(r for r in failed_ranks if r != first_rank)
    also = f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped after it" if others else ""
    if exitcode < 0:
        name = _signal_name(-exitcode)
        why = (
            "; if nothing above says why, the system may have run out of host memory (see dmesg)"
            if -exitcode == signal.SIGKILL
            else ""
        )
        return f"error: rank {first_rank} was killed by {name} before it could report an error{also}{why}"
    return f"error: rank {first_rank} failed first (exit code {exitcode}){also}: its error is above"


def exit_code(exitcode: int) -> int:
    """The launch's exit status for the first failed rank's: its own, or 128 + a signal's number."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        sys.stdout.flush()
        print(failure_line(rank, failure.exitcode, list(failed.failures)), file=sys.stderr, flush=True)
        return exit_code(failure.exitcode)
    except SignalException as stopped:  # the launcher's own signal: forwarded, the ranks have spoken
        return exit_code(-int(stopped.sigval))
    return 0


if __name__ == "__main__":
    sys.exit(main())
