"""``model.quantize: mxfp4`` end to end through ``run_training`` (what ``hone train`` runs) on the
CPU: a tiny MoE with its experts quantized to MXFP4 by the plan trains LoRA on attention and
experts (the experts through the MXFP4 kernels' float32 reference), the record says what was
quantized, and ``hone merge`` merges the adapter into the base with its experts' MXFP4 round trip,
computing what the trained adapter on that base computes."""

import io
import json
import random

import pytest
import torch
from rich.console import Console

from hone.config import parse_config
from hone.run_files import OPTIMIZATIONS_FILE
from hone.track.metrics import read_metrics
from hone.train.run import run_training

STEPS = 4


def _config(tmp_path, preset):
    data = tmp_path / "data.jsonl"
    words = ["red", "green", "blue", "lemon", "lime", "fox", "dog", "quick", "lazy", "yellow"]
    rng = random.Random(0)
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(12))}) + "\n" for _ in range(24)))
    return parse_config(
        {
            "model": {"preset": preset, "dtype": "float32", "quantize": "mxfp4"},
            "data": {
                "datasets": [{"path": str(data), "type": "completion"}],
                "sequence_len": 32,
                "dataset_prepared_path": str(tmp_path / "cache"),
            },
            "adapter": {
                "type": "lora",
                "lora_r": 4,
                "lora_alpha": 8,
                "lora_dropout": 0.0,
                "lora_target_modules": ["q_proj", "v_proj", "experts"],
            },
            "training": {"max_steps": STEPS, "micro_batch_size": 4, "seed": 3, "output_dir": str(tmp_path / "run")},
            "optimizer": {"learning_rate": 1e-2, "lr_scheduler": "constant"},
            "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        }
    )


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-gpt-oss"])
def test_mxfp4_experts_train_lora_and_merge_into_the_round_tripped_base(tmp_path, preset):
    from transformers import AutoModelForCausalLM

    from hone.export.load import load_for_inference
    from hone.export.merge import merge_adapter
    from hone.models.experts.mxfp4 import has_mxfp4_experts

    cfg = _config(tmp_path, preset)
    result = run_training(cfg, device="cpu", console=Console(file=io.StringIO(), width=400))
    losses = [r["loss"] for r in read_metrics(cfg.training.output_dir / "metrics.jsonl") if "loss" in r]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    record = json.loads((cfg.training.output_dir / OPTIMIZATIONS_FILE).read_text())
    applied = {a["name"]: a["details"] for a in record["applied"]}
    assert applied["quantize"]["format"] == "mxfp4" and applied["quantize"]["experts_modules"] == 2
    assert applied["experts"]["implementation"] == "hone"
    adapter_keys = json.loads((result.final_dir / "adapter_config.json").read_text())
    assert "experts" in str(adapter_keys["target_modules"]) or adapter_keys.get("target_parameters")

    trained, _ = load_for_inference(cfg.training.output_dir, device="cpu")
    assert not has_mxfp4_experts(trained)  # the base's experts round-tripped, in float32
    merged_dir = merge_adapter(cfg.training.output_dir, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
