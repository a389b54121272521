"""MXFP4 bases train end to end on CUDA, through ``run_training`` (what ``hone train`` runs) with
the run's defaults (compiled layers, hone's experts kernels): a gpt-oss checkpoint as it ships
(experts read straight to the GPU as blocks and scales) and ``model.quantize: mxfp4`` on a
qwen3-moe preset. The CPU tests prove the arithmetic (tests/unit/test_mxfp4_checkpoint.py,
tests/integration/test_mxfp4_run.py); these prove the CUDA path composes. Skipped without a GPU."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mxfp4_checkpoint import write_mxfp4_gpt_oss  # noqa: E402

from hone.config import parse_config  # noqa: E402
from hone.models.tokenizer import bundled_tokenizer_path  # noqa: E402
from hone.track.metrics import read_metrics  # noqa: E402
from hone.train.run import run_training  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
DEVICE = "cuda"


def _train(model: dict, tmp: Path):
    cfg = parse_config(
        {
            "model": {"dtype": "bfloat16", **model},
            "data": {
                "datasets": [{"path": str(ROOT / "examples" / "data" / "chat_sample.jsonl"), "type": "chat"}],
                "sequence_len": 128,
                "dataset_prepared_path": str(tmp / "cache"),
            },
            "adapter": {"type": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_modules": ["q_proj", "v_proj", "experts"]},
            "training": {"max_steps": STEPS, "micro_batch_size": 4, "output_dir": str(tmp / "run"), "seed": 3},
            "optimizer": {"learning_rate": 5e-3, "warmup_steps": 1},
            "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        }
    )
    result = run_training(cfg, device=DEVICE, console=Console(quiet=True))
    losses = [r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r]
    assert result.steps == STEPS and len(losses) == STEPS
    assert all(torch.isfinite(torch.tensor(losses))), losses
    # the expert LoRA B factors start at zero: non-zero after training means gradients flowed
    # through the MXFP4 kernels (a loss trend over 4 bf16 steps is too noisy to assert on)
    adapter = load_file(str(result.final_dir / "adapter_model.safetensors"))
    expert_b = [t for name, t in adapter.items() if "experts" in name and "lora_B" in name]
    assert expert_b and all(t.abs().sum() > 0 for t in expert_b), sorted(adapter)


def test_a_shipped_mxfp4_checkpoint_trains_on_cuda(tmp_path):
    checkpoint = write_mxfp4_gpt_oss(tmp_path / "gpt-oss", vocab_size=2048, dtype=torch.bfloat16)
    for file in bundled_tokenizer_path().iterdir():
        shutil.copy(file, checkpoint.path / file.name)
    _train({"path": str(checkpoint.path)}, tmp_path)


def test_quantize_mxfp4_trains_a_qwen3_moe_preset_on_cuda(tmp_path):
    _train({"preset": "tiny-qwen3-moe", "quantize": "mxfp4"}, tmp_path)
