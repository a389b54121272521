"""Whether a process of this host still runs: the one test behind every "owner died" decision
(the data cache's stale staging directories, a run directory's stale lock)."""

import os


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists on this host (someone else's process included: signal 0 to it
    is refused, yet it runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
