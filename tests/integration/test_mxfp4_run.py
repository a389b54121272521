"""A gpt-oss checkpoint with MXFP4 experts, as it ships, end to end on the CPU (float32):
``run_training`` (what ``hone train`` runs) with LoRA on attention and every expert learns and
saves a PEFT adapter; ``hone merge`` folds it into the dequantized base and writes an ordinary
model (no ``quantization_config``) whose logits equal PEFT's on the dequantized base; ``hone
generate`` loads the run. The experts run hone's float32 MXFP4 reference (no triton needed)."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mxfp4_checkpoint import Mxfp4Checkpoint, dequantized_reference, write_mxfp4_gpt_oss  # noqa: E402

from hone.config import parse_config  # noqa: E402
from hone.models.tokenizer import bundled_tokenizer_path  # noqa: E402
from hone.track.metrics import read_metrics  # noqa: E402
from hone.train.run import run_training  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Mxfp4Checkpoint, object, object]:
    tmp = tmp_path_factory.mktemp("mxfp4-run")
    checkpoint = write_mxfp4_gpt_oss(tmp / "gpt-oss", vocab_size=2048, dtype=torch.float32)
    for file in bundled_tokenizer_path().iterdir():  # a model directory ships its tokenizer
        shutil.copy(file, checkpoint.path / file.name)
    cfg = parse_config(
        {
            "model": {"path": str(checkpoint.path), "dtype": "float32", "experts_implementation": "hone"},
            "data": {
                "datasets": [{"path": str(ROOT / "examples" / "data" / "chat_sample.jsonl"), "type": "chat"}],
                "sequence_len": 64,
                "dataset_prepared_path": str(tmp / "cache"),
            },
            "adapter": {
                "type": "lora",
                "lora_r": 8,
                "lora_alpha": 16,
                "lora_dropout": 0.0,
                "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "experts"],
            },
            "training": {"max_steps": STEPS, "micro_batch_size": 4, "save_steps": 3, "output_dir": str(tmp / "run"), "seed": 3},
            "optimizer": {"learning_rate": 5e-3, "warmup_steps": 1},
            "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        }
    )
    result = run_training(cfg, device="cpu", console=Console(quiet=True))
    return checkpoint, cfg, result


def test_the_mxfp4_base_trains_expert_lora_and_saves_a_peft_adapter(trained):
    _, cfg, result = trained
    assert result.steps == STEPS
    losses = [r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    saved = json.loads((result.final_dir / "adapter_config.json").read_text())
    assert sorted(saved.get("target_parameters") or []) == ["experts.down_proj", "experts.gate_up_proj"]
    with safe_open(str(result.final_dir / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        expert_b = [f.get_tensor(k) for k in keys if ".experts." in k and ".lora_B." in k]
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)  # no base weight, no blocks, no scales
    assert sum(".experts." in k for k in keys) == 8  # 2 layers x 2 projections x (A, B)
    assert len(expert_b) == 4 and all(b.abs().max() > 0 for b in expert_b)  # B starts at zero: the experts' LoRA trained
    with safe_open(str(next(result.last_checkpoint.glob("*.safetensors"))), framework="pt") as f:
        in_checkpoint = list(f.keys())  # a checkpoint holds the adapter only, never the MXFP4 base
    assert len(in_checkpoint) == len(keys) and all(".lora_A." in k or ".lora_B." in k for k in in_checkpoint)
    record = json.loads((cfg.training.output_dir / "optimizations.json").read_text())
    assert any(a["name"] == "experts" and a["details"]["implementation"] == "hone" for a in record["applied"])


def test_merge_writes_a_plain_model_equal_to_peft_on_thedequantized_reference(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hone.export.load import load_for_inference
    from hone.export.merge import merge_adapter

    checkpoint, cfg, result = trained
    expected_model = PeftModel.from_pretrained(dequantized_reference(checkpoint), str(result.final_dir)).eval()
    ids = torch.randint(5, 2000, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = expected_model(input_ids=ids).logits
        without_adapter = dequantized_reference(checkpoint)(input_ids=ids).logits
    merged_dir = merge_adapter(cfg.training.output_dir, tmp_path / "merged")
    config = json.loads((merged_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    with safe_open(str(next(merged_dir.glob("*.safetensors"))), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj").dtype == torch.float32
    assert not any(k.endswith(("_blocks", "_scales")) or "lora_" in k for k in keys)
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        got = merged(input_ids=ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert (expected - without_adapter).abs().max() > 1e-3  # the adapter changes the logits
        inference, _ = load_for_inference(cfg.training.output_dir, device="cpu")
        torch.testing.assert_close(inference(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_generate_loads_the_mxfp4_run(trained):
    from hone.export.generate import generate, load_for_inference

    _, cfg, _ = trained
    model, tokenizer = load_for_inference(cfg.training.output_dir, device="cpu")
    text = generate(model, tokenizer, "Which color does a lemon have?", max_new_tokens=4)
    assert isinstance(text, str)


def test_chat_on_the_shipped_checkpoint_runs_its_dequantized_experts(trained):
    from hone.export.chat import load_chat_model
    from hone.models.experts.mxfp4 import has_mxfp4_experts

    checkpoint, _, _ = trained
    model, _, setup = load_chat_model(checkpoint.path, device="cpu", dtype="float32")
    assert not has_mxfp4_experts(model) and setup.style == "chat"
    ids = torch.randint(5, 2000, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, dequantized_reference(checkpoint)(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )
