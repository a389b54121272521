"""QLoRA (``model.quantize: nf4``) end to end through ``run_training`` (what ``hone train``
runs): the loss goes down, checkpoints hold the adapter and optimizer only, a resumed run matches
an uninterrupted one, the adapter loads with ``PeftModel.from_pretrained``, ``hone merge``
merges it into the dequantized base, and a regionally compiled run (``aot_eager``) trains like
eager with no graph break and no recompile."""

import io
import json
import os
import random
import signal

import pytest
import torch
from rich.console import Console
from safetensors import safe_open

pytest.importorskip("torchao", reason="NF4 needs the optional 'quant' extra (torchao)")

from hone.config import parse_config  # noqa: E402
from hone.run_files import OPTIMIZATIONS_FILE  # noqa: E402
from hone.track.metrics import read_metrics  # noqa: E402
from hone.train.run import run_training  # noqa: E402

OVERRIDES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "num_hidden_layers": 2,
}
STEPS = 6


def _config(tmp_path, name, performance=None, val_set_size=0.2, **training):
    data = tmp_path.parent / "qlora-data.jsonl"
    if not data.exists():
        words = ["red", "green", "blue", "lemon", "lime", "fox", "dog", "quick", "lazy", "yellow"]
        rng = random.Random(0)
        rows = [{"text": " ".join(rng.choice(words) for _ in range(12))} for _ in range(40)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return parse_config(
        {
            "model": {"preset": "tiny-llama", "preset_overrides": OVERRIDES, "dtype": "float32", "quantize": "nf4"},
            "data": {
                "datasets": [{"path": str(data), "type": "completion"}],
                "val_set_size": val_set_size,
                "sequence_len": 64,
                "dataset_prepared_path": str(tmp_path.parent / "qlora-cache"),
            },
            "adapter": {"type": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_modules": "all-linear"},
            "training": {
                "max_steps": STEPS,
                "micro_batch_size": 4,
                "eval_steps": 3,
                "save_steps": 3,
                "seed": 3,
                "output_dir": str(tmp_path / name),
                **training,
            },
            "optimizer": {"learning_rate": 1e-2, "lr_scheduler": "constant"},
            "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
            "performance": performance or {},
        }
    )


def _train_losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qlora")
    cfg = _config(tmp, "eager")
    out = io.StringIO()
    result = run_training(cfg, device="cpu", console=Console(file=out, width=400))
    return cfg, result, out.getvalue()


def test_qlora_run_learns_and_records_the_quantized_base(eager_run):
    cfg, result, console = eager_run
    assert result.steps == STEPS and result.last_eval_loss < result.first_eval_loss - 0.25
    record = json.loads((cfg.training.output_dir / OPTIMIZATIONS_FILE).read_text())
    applied = {a["name"]: a for a in record["applied"]}
    assert [a["name"] for a in record["applied"]][:2] == ["attention", "quantize"]
    assert applied["quantize"]["details"]["quantized_layers"] == 14
    assert "quantize (nf4: 14 linear layers" in console


def test_checkpoints_hold_the_adapter_and_optimizer_only(eager_run):
    cfg, result, _ = eager_run
    checkpoint = result.last_checkpoint
    weights = next(p for p in checkpoint.iterdir() if p.suffix == ".safetensors")
    with safe_open(str(weights), framework="pt") as f:
        keys = list(f.keys())
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys[:5]
    assert len(keys) == 28  # 14 layers x (A, B): no base weight, quantized or not
    total = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    assert total < 2 * 2**20


def test_resumed_qlora_run_matches_the_uninterrupted_one(eager_run, tmp_path):
    cfg = _config(tmp_path, "resumed")

    def term_at_3(metrics):
        if metrics.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    stopped = run_training(cfg, device="cpu", console=Console(quiet=True), step_callback=term_at_3)
    assert (stopped.interrupted, stopped.steps) == ("SIGTERM", 3)
    resumed_cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"resume": "latest"})})
    resumed = run_training(resumed_cfg, device="cpu", console=Console(quiet=True))
    assert resumed.steps == STEPS
    torch.testing.assert_close(
        torch.tensor(_train_losses(cfg.training.output_dir)),
        torch.tensor(_train_losses(eager_run[0].training.output_dir)),
        rtol=1e-5,
        atol=1e-6,
    )


def test_adapter_loads_with_peft_and_merges_into_the_dequantized_base(eager_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hone.export.load import load_for_inference
    from hone.export.merge import merge_adapter
    from hone.models.loader import build_base_model
    from hone.models.nf4 import NF4Linear, nf4_roundtrip_

    cfg, result, _ = eager_run
    tokenizer = AutoTokenizer.from_pretrained(str(result.final_dir))
    base = build_base_model(cfg.model, tokenizer, torch.device("cpu"), torch.float32, seed=cfg.training.seed)
    assert nf4_roundtrip_(base, torch.float32) == 14
    peft_model = PeftModel.from_pretrained(base, str(result.final_dir)).eval()
    assert not any(isinstance(m, NF4Linear) for m in peft_model.modules())
    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        hone_model, _ = load_for_inference(cfg.training.output_dir, device="cpu")
        torch.testing.assert_close(hone_model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    merged_dir = merge_adapter(cfg.training.output_dir, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_qlora_trains_like_eager_without_graph_breaks_or_recompiles(eager_run, tmp_path):
    from torch._dynamo.utils import counters

    counters.clear()
    cfg = _config(
        tmp_path,
        "compiled",
        {"torch_compile": True, "torch_compile_backend": "aot_eager"},
        val_set_size=0.0,
        max_steps=3,
        eval_steps=None,
        save_steps=None,
    )
    run_training(cfg, device="cpu", console=Console(quiet=True))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    record = json.loads((cfg.training.output_dir / OPTIMIZATIONS_FILE).read_text())
    stats = record["compile"]
    assert stats["counted"] and stats["recompiles"] == 0 and stats["compiles_after_first_step"] == 0, json.dumps(stats)
    assert stats["forward_graphs"] == 1, stats  # one graph for both QLoRA decoder layers
    eager_cfg = _config(tmp_path, "eager", val_set_size=0.0, max_steps=3, eval_steps=None, save_steps=None)
    run_training(eager_cfg, device="cpu", console=Console(quiet=True))
    compiled, eager = _train_losses(cfg.training.output_dir), _train_losses(eager_cfg.training.output_dir)
    assert len(compiled) == 3 and compiled[-1] < compiled[0]
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-5)


def test_a_big_preset_run_draws_its_base_quantized_through_the_plan(tmp_path, monkeypatch):
    """A big (non-tiny) preset is drawn one module at a time and the plan's quantize transform
    turns each linear layer to NF4 as it is drawn (``Plan.as_drawn``), never the whole model in
    full precision; the run then trains as usual."""
    from hone.models import loader

    handed = []
    real = loader.build_preset_model

    def spy(*args, **kwargs):
        handed.append(kwargs.get("as_drawn"))
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "build_preset_model", spy)
    cfg = _config(tmp_path, "big", max_steps=2, eval_steps=None, save_steps=None)
    model = cfg.model.model_copy(update={"preset": "qwen3-8b", "preset_overrides": {**OVERRIDES, "num_key_value_heads": 4}})
    cfg = cfg.model_copy(update={"model": model})
    result = run_training(cfg, device="cpu", console=Console(quiet=True))
    assert result.steps == 2 and handed and handed[0] is not None
    record = json.loads((cfg.training.output_dir / OPTIMIZATIONS_FILE).read_text())
    assert {a["name"]: a for a in record["applied"]}["quantize"]["details"]["quantized_layers"] == 14
