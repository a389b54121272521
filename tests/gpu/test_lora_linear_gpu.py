"""The fused LoRA linear on a CUDA GPU at an 8B model's shapes (8,192 tokens; hidden 4096,
intermediate 14336; r 16): hone's precision (bf16 base and activations, float32 factors,
autocast) against PEFT's arithmetic on the same operands, eager and compiled, on a bf16 base and
on a float8 one (compute capability >= 8.9). Tolerance: relative error in norm < 1e-2 (bf16
rounding of sums over thousands of tokens), the float8 base against its own reference.

Run: pytest -q -m gpu tests/gpu/test_lora_linear_gpu.py
"""

import pytest
import torch

from hone.kernels.fp8_linear import quantize_frozen_weight
from hone.kernels.lora_linear import lora_linear, lora_linear_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

TOKENS, RANK, SCALING = 8192, 16, 2.0
SHAPES = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "down_proj": (4096, 14336)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(fn, x, base, a, b, grad):
    x, a, b = (t.detach().clone().requires_grad_() for t in (x, a, b))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fn(x, base, None, a, b, SCALING)
    y.backward(grad)
    return y, x.grad, a.grad, b.grad


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("base_kind", ["bf16", "fp8-tensorwise", "fp8-rowwise"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_fused_matches_peft_arithmetic_at_8b_shapes(name, base_kind, compiled):
    if base_kind.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability >= 8.9")
    out_features, in_features = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(2, TOKENS // 2, in_features, device="cuda", generator=gen).to(torch.bfloat16)
    a = torch.randn(RANK, in_features, device="cuda", generator=gen) * 0.02
    b = torch.randn(out_features, RANK, device="cuda", generator=gen) * 0.02
    grad = torch.randn(2, TOKENS // 2, out_features, device="cuda", generator=gen).to(torch.bfloat16)
    base = weight if base_kind == "bf16" else quantize_frozen_weight(weight, base_kind.split("-")[1])
    fused = torch.compile(lora_linear, fullgraph=True) if compiled else lora_linear
    got = _run(fused, x, base, a, b, grad)
    want = _run(lora_linear_reference, x, base, a, b, grad)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    for label, g, w in zip(("out", "dx", "dA", "dB"), got, want):
        assert _rel(g, w) < 1e-2, f"{label}: {_rel(g, w):.2e}"
