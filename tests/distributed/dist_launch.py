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


def tiny_moe_train_config(out: Path, training: dict, distributed: dict, **sections: dict) -> Path:
    """A ``hone train`` config file in ``out`` for the tiny qwen3-moe on a small completion set it
    writes there: LoRA r4 on q_proj and the experts, fp32, no trackers; ``training`` (beside
    ``output_dir: out/run``), ``distributed`` and any other whole ``sections`` as given."""
    import json

    import yaml

    data = out / "data.jsonl"
    rows = [{"text": " ".join(["red green blue lemon lime fox"] * (1 + i % 3))} for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "model": {"preset": "tiny-qwen3-moe", "dtype": "float32"},
        "data": {
            "datasets": [{"path": str(data), "type": "completion"}],
            "sequence_len": 32,
            "dataset_prepared_path": str(out / "c"),
        },
        "adapter": {"type": "lora", "lora_r": 4, "lora_target_modules": ["q_proj", "experts"]},
        "training": {"output_dir": str(out / "run"), **training},
        "optimizer": {"learning_rate": 5e-3},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "distributed": distributed,
        **sections,
    }
    path = out / "cfg.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path
