"""Launching 2 processes with ``torchrun`` from a test: a subprocess with a timeout (a hang fails
the test instead of stalling the suite)."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORKER = HERE / "dist_worker.py"
#: A launch that has not finished by then has hung (a 2-process tiny run takes ~10-30 s).
TIMEOUT_S = 180


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a launched process: this checkout first on the import path, one thread
    per process (2 processes on a small CI machine)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # these tests are about the CPU path (gloo)
    env.update(extra)
    return env


def run(command: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=child_env(), cwd=cwd or REPO, capture_output=True, text=True, timeout=TIMEOUT_S)


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def run_worker(scenario: str, out: Path, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    proc = run(torchrun(str(WORKER), scenario, str(out), str(seed)))
    assert proc.returncode == 0, f"{scenario} (seed {seed}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
