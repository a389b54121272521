"""The MXFP4 grouped expert kernels (hone.kernels.moe_mxfp4: MXFP4 weight tiles decoded in the
grouped GEMM's registers, forward and input gradient, LoRA fused) against the plain-PyTorch
reference that dequantizes to float32 first, on CPU under Triton's interpreter in float32:
output and the gradients of x, LoRA A/B and the biases within 1e-5; the LoRA gradients equal,
bit for bit, those of the bf16 kernels' path on the dequantized weight (they never read W);
one projection with two experts of four empty, and whole experts in both layouts; opcheck and
``torch.compile(fullgraph=True)``. Each case runs in a subprocess (tests/kernels/moe_mxfp4_checks.py:
``TRITON_INTERPRET=1`` must be set before triton is imported); skipped without triton.
tests/gpu/test_moe_mxfp4_gpu.py checks bf16 at gpt-oss-20b's shapes."""

from pathlib import Path

import pytest
import torch
from interpreted import needs_triton, run_interpreted

from hone.kernels.moe_lora import route
from hone.kernels.moe_mxfp4 import moe_mxfp4_linear

CHECKS = Path(__file__).with_name("moe_mxfp4_checks.py")


def _interpreted(case: str) -> dict:
    return run_interpreted([str(CHECKS), case])


def _too_far(errors: dict, tolerance: float = 1e-5) -> dict:
    return {name: err for name, err in errors.items() if isinstance(err, str) or err > tolerance}


@needs_triton
def test_projection_forward_and_gradients_match_reference_and_bf16_path():
    result = _interpreted("linear")
    assert result["rows_per_expert"] == [10, 0, 10, 0]  # empty experts among full ones
    assert set(result["errors"]) == {"y", "x", "A", "B", "bias"}
    assert not _too_far(result["errors"]), result["errors"]
    # dA / dB: the bf16 path's own launches on the same inputs, so bit for bit equal
    assert result["lora_grads_equal_bf16_path"] == {"A": True, "B": True}
    assert not _too_far(result["errors_vs_bf16_path"]), result["errors_vs_bf16_path"]


@needs_triton
def test_input_gradient_without_lora_or_gather():
    errors = _interpreted("input_grad_only")["errors"]
    assert set(errors) == {"y", "x"} and not _too_far(errors), errors


@needs_triton
@pytest.mark.parametrize("layout", ["gptoss", "qwen"])
def test_experts_match_dequantized_reference(layout):
    result = _interpreted(f"experts_{layout}")
    expected = {"out", "hidden", "routing_weights", "gu_A", "gu_B", "dn_A", "dn_B"}
    if layout == "gptoss":
        expected |= {"gate_up_bias", "down_bias"}
        assert result["clamped_fraction"] > 0.01  # the clamped SwiGLU is exercised
    assert set(result["errors"]) == expected
    assert not _too_far(result["errors"]), result["errors"]


@needs_triton
def test_ops_pass_opcheck():
    assert _interpreted("opcheck") == {"grouped_mm_forward": "ok", "grouped_mm_input_grad": "ok", "lora_linear": "ok"}


@needs_triton
def test_compile_fullgraph_equals_eager():
    errors = _interpreted("compile")["errors"]
    assert not _too_far(errors, 1e-6), errors


def test_weight_that_does_not_fit_the_inputs_is_refused():
    _, ends = route(torch.zeros(4, 1, dtype=torch.long), 2)
    x = torch.randn(4, 64)
    blocks = torch.zeros(2, 8, 3, 16, dtype=torch.uint8)  # 96 inputs, not 64
    with pytest.raises(ValueError, match=r"blocks \(2, 8, 3, 16\).*width 64"):
        moe_mxfp4_linear(x, None, ends, (blocks, torch.zeros(2, 8, 3, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="disagree"):
        moe_mxfp4_linear(x, None, ends, (blocks[:, :, :2], torch.zeros(2, 8, 3, dtype=torch.uint8)))
