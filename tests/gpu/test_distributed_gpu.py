"""Two GPUs, NCCL, through the CLI: ``hone train CFG --nproc-per-node 2`` gives the losses and
adapter of one GPU with twice the accumulation (fp32; eager and with regional Inductor compile
plus full checkpointing), and more processes than GPUs is refused before anything starts.

Run on a machine with at least 2 GPUs:  python -m pytest -q -m gpu tests/gpu/test_distributed_gpu.py
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hone.track.metrics import read_metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

REPO = Path(__file__).resolve().parent.parent.parent
TIMEOUT_S = 600


def _config(tmp_path: Path, name: str, accumulation: int, performance=None, memory=None) -> Path:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        rng = random.Random(0)
        data.write_text(
            "".join(
                json.dumps({"input_ids": [rng.randint(5, 250) for _ in range(rng.randint(16, 96))]}) + "\n" for _ in range(64)
            )
        )
    cfg = {
        "model": {"preset": "tiny-qwen3", "preset_overrides": {"num_hidden_layers": 4}, "dtype": "float32"},
        "data": {
            "datasets": [{"path": str(data), "type": "pretokenized"}],
            "sequence_len": 128,
            "sample_packing": True,
            "val_set_size": 0.1,
            "dataset_prepared_path": str(tmp_path / "cache"),
        },
        "adapter": {"type": "lora", "lora_r": 8},
        "training": {
            "max_steps": 5,
            "micro_batch_size": 1,
            "gradient_accumulation_steps": accumulation,
            "eval_steps": 5,
            "output_dir": str(tmp_path / name),
            "seed": 3,
        },
        "optimizer": {"learning_rate": 1e-3, "lr_scheduler": "constant"},
        "performance": {"torch_compile": False, "loss": "standard", **(performance or {})},
        "memory": memory or {},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
    }
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _hone(*args: str, gpus: str = "0,1") -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": gpus,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "hone", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _losses(run_dir: Path) -> tuple[list[float], list[float]]:
    rows = read_metrics(run_dir / "metrics.jsonl")
    return [r["loss"] for r in rows if "loss" in r], [r["eval_loss"] for r in rows if "eval_loss" in r]


@pytest.mark.parametrize("variant", ["eager", "compiled+checkpointing"])
def test_two_gpus_equal_one_gpu_with_twice_the_accumulation(tmp_path, variant):
    extra = {}
    if variant != "eager":
        extra = {"performance": {"torch_compile": True}, "memory": {"activation_checkpointing": "full"}}
    one = _hone("train", str(_config(tmp_path, "one", 2, **extra)), gpus="0")
    assert one.returncode == 0, one.stderr[-4000:]
    two = _hone("train", str(_config(tmp_path, "two", 1, **extra)), "--nproc-per-node", "2")
    assert two.returncode == 0, two.stderr[-4000:]
    (t1, e1), (t2, e2) = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(t2) == len(t1) == 5
    assert t2 == pytest.approx(t1, rel=1e-4) and e2 == pytest.approx(e1, rel=1e-4)
    applied = json.loads((tmp_path / "two" / "optimizations.json").read_text())["applied"]
    assert any(a["name"] == "ddp" and a["details"].get("backend") == "nccl" for a in applied)
    from safetensors.torch import load_file

    w1 = load_file(str(tmp_path / "one" / "final" / "adapter_model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "final" / "adapter_model.safetensors"))
    for key, weight in w1.items():
        torch.testing.assert_close(w2[key], weight, rtol=1e-4, atol=1e-4 * weight.abs().max().item(), msg=key)


def test_more_processes_than_gpus_is_refused_before_starting(tmp_path):
    proc = _hone("train", str(_config(tmp_path, "too-many", 1)), "--nproc-per-node", "3")
    assert proc.returncode == 2
    assert "--nproc-per-node 3" in proc.stderr and "2 visible CUDA devices" in proc.stderr
    assert not (tmp_path / "too-many").exists()


def _long_run(tmp_path: Path, name: str, strategy: str) -> Path:
    path = _config(tmp_path, name, 1, memory={})
    cfg = yaml.safe_load(path.read_text())
    cfg["training"].update(max_steps=40, save_steps=4, eval_steps=40)
    cfg["distributed"] = {"strategy": strategy}
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_killed_two_gpu_run_resumes_from_its_last_complete_checkpoint(tmp_path, strategy):
    """SIGKILL to the whole launch mid-run, then the same command with ``training.resume:
    latest``: from the checkpoint on, the uninterrupted run's losses (tests/distributed/killed_run.py)."""
    sys.path.insert(0, str(REPO / "tests" / "distributed"))
    from killed_run import kill_and_resume, train_losses

    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "0,1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = kill_and_resume(
        _long_run(tmp_path, "straight", strategy), _long_run(tmp_path, "killed", strategy), env, kill_after=8, timeout_s=TIMEOUT_S
    )
    want, got = train_losses(tmp_path / "straight"), train_losses(tmp_path / "killed")
    after = list(range(done + 1, 41))
    assert after and [got[s] for s in after] == pytest.approx([want[s] for s in after], rel=1e-5)


def test_fsdp_cpu_offload_trains_like_gpu_resident_fsdp(tmp_path):
    """``distributed.cpu_offload`` keeps parameters, gradients and optimizer state on the host
    (FSDP2's CPUOffloadPolicy): the same losses as GPU-resident FSDP2 (fp32)."""
    runs = {}
    for name, offload in (("resident", False), ("offloaded", True)):
        path = _config(tmp_path, name, 1, memory={})
        cfg = yaml.safe_load(path.read_text())
        cfg["adapter"] = {"type": "none"}
        cfg["distributed"] = {"strategy": "fsdp", "cpu_offload": offload}
        path.write_text(yaml.safe_dump(cfg))
        proc = _hone("train", str(path), "--nproc-per-node", "2")
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = _losses(tmp_path / name)
    (t1, e1), (t2, e2) = runs["resident"], runs["offloaded"]
    assert len(t1) == len(t2) == 5
    assert t2 == pytest.approx(t1, rel=1e-4) and e2 == pytest.approx(e1, rel=1e-4)
