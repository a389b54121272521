"""The float8 frozen-weight linear on the CPU, where torch's ``_scaled_mm`` runs too:
quantization, the linear against the dequantized reference (output and input gradient),
against the high-precision matmul within float8's error, and fullgraph compiles (Dynamo and
AOTAutograd trace it forward and backward, no graph break) for both scaling modes."""

import pytest
import torch

from hone.kernels.fp8_linear import (
    FP8,
    FP8_MAX,
    MODES,
    dequantize,
    fp8_frozen_linear,
    fp8_linear_reference,
    quantize,
    quantize_frozen_weight,
)

# e4m3 keeps 3 mantissa bits: each operand is within 2**-4 of its value, a dot product of
# random operands within a few percent in norm. 8% leaves room for either operand's rounding.
FP8_REL_TOL = 0.08


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _operands(seed: int, dtype=torch.float32, n=48, k=64):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = (torch.randn(3, 5, k, generator=gen) * 3).to(dtype)
    grad = torch.randn(3, 5, n, generator=gen).to(dtype)
    return w, x, grad


@pytest.mark.parametrize("mode", MODES)
def test_quantize_scales_each_row_or_the_tensor_to_the_float8_range(mode):
    t = torch.randn(8, 32) * torch.arange(1, 9).unsqueeze(1)  # rows of different magnitude
    q, scale = quantize(t, mode)
    assert q.dtype == FP8 and scale.dtype == torch.float32
    assert scale.shape == ((8, 1) if mode == "rowwise" else ())
    amax = q.float().abs().amax(dim=-1) if mode == "rowwise" else q.float().abs().amax()
    torch.testing.assert_close(amax, torch.full_like(amax, FP8_MAX))  # every row (or the tensor) uses the range
    assert _rel(dequantize(q, scale), t) < 0.05


def test_rowwise_weight_is_scaled_per_output_row_and_its_transpose_per_input_column():
    w = torch.randn(32, 48) * torch.linspace(0.1, 10, 48)  # input columns of very different size
    q = quantize_frozen_weight(w, "rowwise")
    assert q.w_q.shape == (32, 48) and q.w_scale.shape == (32, 1)
    assert q.wt_q.shape == (48, 32) and q.wt_scale.shape == (48, 1) and q.wt_q.is_contiguous()
    torch.testing.assert_close(q.wt_scale.squeeze(1), w.abs().amax(dim=0) / FP8_MAX)
    # per-column scaling is what keeps the small columns accurate in dY @ W
    assert _rel(dequantize(q.wt_q, q.wt_scale).t()[:, :4], w[:, :4]) < 0.05


def test_tensorwise_transpose_holds_the_same_values():
    w = torch.randn(32, 48)
    q = quantize_frozen_weight(w, "tensorwise")
    assert torch.equal(q.wt_q.float(), q.w_q.float().t()) and torch.equal(q.wt_scale, q.w_scale)


def test_weights_that_scaled_mm_cannot_take_are_refused():
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_frozen_weight(torch.randn(30, 64), "rowwise")


@pytest.mark.parametrize("mode", MODES)
def test_op_equals_the_dequantized_reference_output_and_input_gradient(mode):
    w, x, grad = _operands(seed=1)
    fp8_w = quantize_frozen_weight(w, mode)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, ref = fp8_frozen_linear(x1, fp8_w), fp8_linear_reference(x2, fp8_w)
    y.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_op_tracks_the_high_precision_matmul_within_float8_error(mode):
    w, x, grad = _operands(seed=2)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = fp8_frozen_linear(x1, quantize_frozen_weight(w, mode))
    exact = x2 @ w.t()
    y.backward(grad)
    exact.backward(grad)
    assert 1e-4 < _rel(y, exact) < FP8_REL_TOL  # really float8 (not exact), and close
    assert 1e-4 < _rel(x1.grad, x2.grad) < FP8_REL_TOL


def test_bf16_inputs_give_bf16_outputs_within_float8_error():
    w, x, _ = _operands(seed=3, dtype=torch.bfloat16)
    y = fp8_frozen_linear(x, quantize_frozen_weight(w, "rowwise"))
    assert y.dtype == torch.bfloat16 and y.shape == (3, 5, 48)
    assert _rel(y, x.float() @ w.float().t()) < FP8_REL_TOL


@pytest.mark.parametrize("mode", MODES)
def test_fullgraph_compile_traces_the_linear_with_no_graph_break(mode):
    w, x, grad = _operands(seed=5)
    q = quantize_frozen_weight(w, mode)

    def layer(t):
        return torch.nn.functional.silu(fp8_frozen_linear(t * 2, q))

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, ref = compiled(x1), layer(x2)
    y.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(x1.grad, x2.grad)
