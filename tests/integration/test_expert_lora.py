"""LoRA on the experts of a tiny MoE model through hone's experts backend (``hone``), on CPU
under Triton's interpreter: the same logits and LoRA gradients as PEFT's own
``target_parameters`` path on the eager experts, an adapter that plain
``PeftModel.from_pretrained`` loads and ``merge_and_unload`` merges to the same logits. Each
check runs in a subprocess (tests/integration/expert_lora_checks.py), as ``TRITON_INTERPRET``
must be set before triton is imported; skipped where triton is not installed."""

import importlib.util
from pathlib import Path

import pytest
from interpreted import run_interpreted


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (CPU-only torch)")
def test_expert_lora_through_hone_backend_equals_peft_and_round_trips():
    r = _check("qwen3_moe", timeout_s=600)
    assert r["hone_wrappers"] == 4  # 2 layers x (gate_up_proj, down_proj) through hone's kernels
    assert r["expert_lora_params"] == 8 and r["same_trainable"]
    assert r["logits"] < 1e-5 and r["grads"] < 1e-5
    assert r["saved_target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    assert r["loaded_logits"] < 1e-5 and r["merged_logits"] < 1e-5


def _check(case: str, timeout_s: int = 1200) -> dict:
    return run_interpreted([str(Path(__file__).with_name("expert_lora_checks.py")), case], timeout_s)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (CPU-only torch)")
def test_gpt_oss_expert_lora_in_its_own_layout_equals_peft_and_round_trips():
    """gpt_oss end to end: transposed [E, in, out] weights, interleaved gate/up, per-expert
    biases and clamped SwiGLU through hone's kernels, against PEFT on the eager experts."""
    r = _check("gpt_oss")
    assert r["hone_wrappers"] == 4 and r["expert_lora_params"] == 8 and r["same_trainable"]
    assert r["logits"] < 1e-5 and r["grads"] < 1e-5
    assert r["saved_target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    assert r["loaded_logits"] < 1e-5 and r["merged_logits"] < 1e-5


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (CPU-only torch)")
@pytest.mark.long  # ~4 minutes of training under the interpreter: make test-kernels
def test_tiny_gpt_oss_learns_the_sample_task_with_hone_experts_as_with_eager():
    """A short ``run_training`` (tiny-gpt-oss, LoRA on attention and every expert, attention
    through hone's sink backend) with hone's experts under the interpreter and with the eager
    experts: the loss falls, and step by step the two runs agree (same seed, same data)."""
    losses = _check("train")
    hone, eager = losses["hone"], losses["eager"]
    assert len(hone) == len(eager) == 8
    assert eager[0] - min(eager[-3:]) > 0.3  # it learns
    for step, (a, b) in enumerate(zip(hone, eager), 1):
        assert abs(a - b) <= 1e-4 * abs(b), (step, a, b)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (CPU-only torch)")
def test_expert_lora_model_compiles_fullgraph_through_peft_and_hone_kernels():
    r = _check("compile", timeout_s=600)  # a graph break under fullgraph=True fails the subprocess
    assert r["expert_grads"] == 8
    assert r["logits"] < 1e-6 and r["grads"] < 1e-6
