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
        data.write_text("".join(json.dumps({"input_ids": [rng.randint(5, 250) for _ in range(rng.randint(16, 96))]}) + "\n" for _ in range(64)))
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
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "hone", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)


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
