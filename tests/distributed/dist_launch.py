"""Launching 2 processes with ``torchrun`` from a test: a subprocess with a timeout (a hang fails
the test instead of stalling the suite). ``run_worker`` runs a scenario of ``dist_worker.py`` on
2 gloo processes forked by :mod:`fsdp_harness` (with the same timeout): the scenarios test what
the ranks do together, and a torchrun launch costs every rank its imports again."""

import os
import subprocess
import sys
from pathlib import Path

from fsdp_harness import spawn

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


def _scenario(rank: int, scenario: str, out: Path, seed: int) -> None:
    from dist_worker import SCENARIOS

    from hone.train.distributed import init_world

    SCENARIOS[scenario](init_world("cpu"), out, seed)  # the harness joined the group: init_world returns its world


def run_worker(scenario: str, out: Path, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    try:
        spawn(_scenario, 2, scenario, out, seed, timeout_s=TIMEOUT_S)
    except Exception as exc:
        raise AssertionError(f"{scenario} (seed {seed}) failed:\n{exc}") from exc


def _hone_train(rank: int, cfg: Path) -> None:
    from hone.cli import main

    code = main(["train", str(cfg)])
    assert code == 0, f"hone train {cfg} exited {code} on rank {rank}"


def hone_train_forked(cfg: Path, processes: int = 2) -> None:
    """``hone train CFG`` in ``processes`` processes forked by the harness (as ``torchrun -m hone
    train CFG`` runs it in each rank), with the launch timeout: a run whose launch is not under test."""
    spawn(_hone_train, processes, cfg, timeout_s=TIMEOUT_S)
