"""Expert LoRA through hone's experts backend on a tiny MoE model, against PEFT's own path.

Run as ``python tests/integration/expert_lora_checks.py CASE`` with ``TRITON_INTERPRET=1`` (CPU)
or on a GPU; prints ``RESULT {json}``. Cases:

- ``qwen3_moe`` / ``gpt_oss``: tiny-qwen3-moe / tiny-gpt-oss (float32), LoRA on attention and every expert through
  hone's adapter with ``experts_implementation: hone`` against the same adapter weights under
  plain PEFT on the eager experts: logits and every LoRA gradient; then the adapter saved by
  hone is loaded by ``PeftModel.from_pretrained`` into a fresh eager model (same logits), and
  merged with ``merge_and_unload`` (same logits again). gpt_oss runs its own layout end to
  end: transposed ``[E, in, out]`` weights, interleaved gate/up, per-expert biases, clamped SwiGLU.
- ``train``: ``run_training`` on the bundled chat sample (tiny-gpt-oss, LoRA on attention and
  every expert) once with ``experts_implementation: hone`` and once with ``eager``, same seed:
  both losses per step (the caller checks that both learn, and learn alike).
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch
from peft import PeftModel

from hone.config.adapter import AdapterConfig
from hone.models.adapters import apply_adapter
from hone.models.experts import set_experts_implementation
from hone.models.experts.lora import HoneExpertsLora
from hone.testing import tiny_model, tiny_tokenizer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _randomize_lora(model, seed: int) -> None:
    """Nonzero B (PEFT starts it at zero, which makes every A gradient zero)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.1


def check_expert_lora(preset: str) -> dict:
    tokenizer = tiny_tokenizer()
    adapter = AdapterConfig(type="lora", lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj", "experts"])
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, len(tokenizer), (1, 10), generator=gen)

    fused_base = tiny_model(preset, tokenizer, seed=1)
    set_experts_implementation(fused_base, "hone")
    fused = apply_adapter(fused_base, adapter)
    _randomize_lora(fused, seed=2)
    wrappers = [m for m in fused.modules() if isinstance(m, HoneExpertsLora)]

    plain_base = tiny_model(preset, tokenizer, seed=1)
    set_experts_implementation(plain_base, "eager")
    plain = apply_adapter(plain_base, adapter)
    plain.load_state_dict(fused.state_dict())
    assert not any(isinstance(m, HoneExpertsLora) for m in plain.modules())

    results = {}
    for name, model in (("fused", fused), ("plain", plain)):
        logits = model(input_ids=input_ids).logits
        logits.float().pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[name] = (logits.detach(), grads)
    (fused_logits, fused_grads), (plain_logits, plain_grads) = results["fused"], results["plain"]
    out = {
        "hone_wrappers": len(wrappers),
        "expert_lora_params": sum("experts" in n for n in fused_grads),
        "logits": _rel(fused_logits, plain_logits),
        "grads": max(_rel(fused_grads[n], plain_grads[n]) for n in plain_grads),
        "same_trainable": sorted(fused_grads) == sorted(plain_grads),
    }

    with tempfile.TemporaryDirectory() as tmp:
        fused.save_pretrained(tmp)
        with open(f"{tmp}/adapter_config.json") as f:
            saved = json.load(f)
        out["saved_target_parameters"] = sorted(saved.get("target_parameters") or [])
        fresh = tiny_model(preset, tokenizer, seed=1)
        set_experts_implementation(fresh, "eager")
        loaded = PeftModel.from_pretrained(fresh, tmp)
        with torch.no_grad():
            out["loaded_logits"] = _rel(loaded(input_ids=input_ids).logits, fused_logits)
            merged = loaded.merge_and_unload()
            out["merged_logits"] = _rel(merged(input_ids=input_ids).logits, fused_logits)
    return out


def check_compile(preset: str = "tiny-qwen3-moe") -> dict:
    """The adapted model with hone's experts under ``torch.compile(fullgraph=True)`` (aot_eager:
    forward and backward traced, kernels run as they are): no graph break, same logits and grads."""
    tokenizer = tiny_tokenizer()
    adapter = AdapterConfig(type="lora", lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "experts"])
    base = tiny_model(preset, tokenizer, seed=1)
    set_experts_implementation(base, "hone")
    model = apply_adapter(base, adapter)
    _randomize_lora(model, seed=2)
    input_ids = torch.randint(0, len(tokenizer), (1, 10), generator=torch.Generator().manual_seed(0))
    results = []
    for fn in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        logits = fn(input_ids=input_ids).logits
        logits.float().pow(2).mean().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (eager_logits, eager_grads), (compiled_logits, compiled_grads) = results
    return {
        "logits": _rel(compiled_logits, eager_logits),
        "grads": max(_rel(compiled_grads[n], eager_grads[n]) for n in eager_grads),
        "expert_grads": sum("experts" in n for n in compiled_grads),
    }


def check_train() -> dict:
    """Losses per step of the same short run with hone's experts and with the eager experts."""
    from pathlib import Path

    from rich.console import Console

    from hone.config import parse_config
    from hone.track.metrics import read_metrics
    from hone.train.run import run_training

    data = Path(__file__).resolve().parents[2] / "examples" / "data" / "chat_sample.jsonl"
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        for implementation in ("hone", "eager"):
            cfg = parse_config(
                {
                    "model": {"preset": "tiny-gpt-oss", "dtype": "float32", "experts_implementation": implementation},
                    "data": {
                        "datasets": [{"path": str(data), "type": "chat"}],
                        "sequence_len": 64,
                        "dataset_prepared_path": f"{tmp}/cache",
                    },
                    "adapter": {
                        "type": "lora",
                        "lora_r": 8,
                        "lora_alpha": 16,
                        "lora_dropout": 0.0,
                        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "experts"],
                    },
                    "training": {"max_steps": 8, "micro_batch_size": 4, "output_dir": f"{tmp}/{implementation}", "seed": 3},
                    "optimizer": {"learning_rate": 5e-3, "warmup_steps": 2},
                    "logging": {"progress_bar": False},
                }
            )
            result = run_training(cfg, device="cpu", console=Console(quiet=True))
            losses[implementation] = [r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r]
    return losses


if __name__ == "__main__":
    which = sys.argv[1]
    result = {
        "qwen3_moe": lambda: check_expert_lora("tiny-qwen3-moe"),
        "gpt_oss": lambda: check_expert_lora("tiny-gpt-oss"),
        "compile": check_compile,
        "train": check_train,
    }[which]()
    print("RESULT " + json.dumps(result))
