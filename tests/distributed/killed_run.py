"""A data-parallel run killed mid-training and resumed, shared by the CPU (gloo) test and the
two-GPU (NCCL) one: the run is launched as a user would (``hone train CFG --nproc-per-node 2``),
SIGKILLed with its whole process group once a checkpoint is complete (no graceful stop, maybe
mid-write of the next one), then the same command runs again with ``training.resume: latest``.

torchrun starts each rank in a session of its own, so the kill reaches the launcher only: the
ranks must die with it (hone.train.lifeline), within seconds, and leave the run directory's lock
to the resumed run (hone.train.run_lock), which takes it over with a note."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from hone.track.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent.parent


def _launch(cfg: Path, env: dict[str, str]) -> subprocess.Popen:
    # a session of its own, so the kill reaches torchrun and both ranks, as an out-of-memory killer
    # or a preempted node would
    return subprocess.Popen(
        [sys.executable, "-m", "hone", "train", str(cfg), "--nproc-per-node", "2"],
        env=env,
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(cfg: Path, env: dict[str, str], timeout_s: float) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "hone", "train", str(cfg), "--nproc-per-node", "2"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (a dead rank whose new parent has not reaped it yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def assert_ranks_die(ranks: list[int], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while any(running(pid) for pid in ranks):
        if time.monotonic() > deadline:
            alive = [pid for pid in ranks if running(pid)]
            for pid in alive:  # do not leave them training behind the test
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"ranks {alive} outlived their killed launcher by {within_s} s")
        time.sleep(0.05)


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def kill_and_resume(
    straight_cfg: Path,
    killed_cfg: Path,
    env: dict[str, str],
    kill_after: int,
    timeout_s: float = 600,
    straight: Callable[[Path], None] | None = None,
) -> int:
    """Run ``straight_cfg`` to the end (with ``straight(cfg)`` where given, else as the killed run
    is launched); run ``killed_cfg`` (the same run, another output_dir) and SIGKILL it once
    ``step-{kill_after}`` is complete; resume it to the end. Returns the step of the newest
    complete checkpoint the kill left (what the resumed run started from)."""
    if straight is not None:
        straight(straight_cfg)
    else:
        _finish(straight_cfg, env, timeout_s)
    cfg = yaml.safe_load(killed_cfg.read_text())
    run_dir = Path(cfg["training"]["output_dir"])
    checkpoints = run_dir / "checkpoints"
    proc = _launch(killed_cfg, env)
    deadline = time.monotonic() + timeout_s
    while not (checkpoints / f"step-{kill_after}" / "COMPLETE").exists():
        assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.stderr.read()[-4000:]}"
        assert time.monotonic() < deadline, f"no complete checkpoint at step {kill_after} after {timeout_s} s"
        time.sleep(0.01)
    ranks = children_of(proc.pid)
    assert len(ranks) == 2, f"expected the launcher's 2 ranks, found {ranks}"
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: the ranks have sessions of their own
    finished_before = (run_dir / "final").exists()
    proc.wait(timeout=60)
    assert not finished_before, "the run finished before the kill: give it more steps"
    assert_ranks_die(ranks)
    # ranks that outlive their launcher keep training: a quick run's would have finished it by now
    assert not (run_dir / "final").exists(), "the ranks outlived their launcher and wrote final/"
    done = max(int(p.name.split("-")[1]) for p in checkpoints.glob("step-*") if (p / "COMPLETE").exists())
    assert done >= kill_after
    cfg["training"]["resume"] = "latest"
    killed_cfg.write_text(yaml.safe_dump(cfg))
    stderr = _finish(killed_cfg, env, timeout_s)
    assert "taking over the run directory lock of a run that is gone" in stderr
    return done
