"""A rank dies with its launcher (issue 30, item 13): a child started in a session of its own, as
torchrun starts ranks, is killed when its parent is SIGKILLed, and refuses to start when its
recorded launcher is already gone."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hone.train.lifeline import LAUNCHER_PID_ENV

ROOT = Path(__file__).resolve().parents[2]

#: The "launcher": starts one "rank" in a new session (as torchrun does), prints its pid, waits.
LAUNCHER = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(rank.pid, flush=True)
time.sleep(600)
"""

RANK = """
import sys, time
from hone.train.lifeline import die_with_launcher
die_with_launcher(watchdog_only={watchdog})
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("watchdog", [False, True], ids=["pdeathsig", "watchdog"])
def test_a_rank_in_its_own_session_dies_with_its_killed_launcher(watchdog):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(LAUNCHER_PID_ENV, None)
    rank_code = RANK.format(watchdog=watchdog)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, rank_code], env=env, stdout=subprocess.PIPE, text=True)
    rank = int(launcher.stdout.readline())
    try:
        time.sleep(3)  # the rank imports hone and arms its parent-death signal
        assert _running(rank)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while _running(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(rank), "the rank outlived its launcher"
    finally:
        if _running(rank):
            os.kill(rank, signal.SIGKILL)
        launcher.stdout.close()


def test_a_rank_whose_launcher_is_already_gone_stops():
    # in a child: arming the parent-death signal in pytest itself would outlive the test
    code = "from hone.train.lifeline import die_with_launcher; die_with_launcher()"
    env = {**os.environ, "PYTHONPATH": str(ROOT), LAUNCHER_PID_ENV: "1"}  # not its parent: that launcher is gone
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "LauncherGone: the launcher of this rank (pid 1) is gone" in proc.stderr
