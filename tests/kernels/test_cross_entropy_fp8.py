"""The fused linear cross-entropy through a frozen float8 head (CPU, ``torch._scaled_mm``)
against its reference (the same quantization on dequantized operands, then the standard loss):
value and hidden-state gradient (rowwise: a tensorwise head is refused), ignored rows, ragged chunks, no_grad,
the custom op's registration, and ``torch.compile(fullgraph=True)``."""

import pytest
import torch
from torch import nn

from hone.kernels.cross_entropy_fp8 import (
    _fused_fp8_op,
    fused_linear_cross_entropy_fp8,
    linear_cross_entropy_fp8_reference,
)
from hone.kernels.fp8_linear import quantize_frozen_weight

IGNORE = -100
HIDDEN, VOCAB = 32, 80  # _scaled_mm wants both dimensions of the head multiples of 16


def _inputs(n, mode="rowwise", ignore=(), seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, HIDDEN, generator=gen).requires_grad_(True)
    w = torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5
    t = torch.randint(0, VOCAB, (n,), generator=gen)
    t[list(ignore)] = IGNORE
    return h, quantize_frozen_weight(w, mode), t


def _value_and_grad(loss_fn, h, w, t, **kwargs):
    h = h.detach().clone().requires_grad_(True)
    loss = loss_fn(h, w, t, **kwargs)
    (loss / 7).backward()
    return loss.detach(), h.grad


@pytest.mark.parametrize(
    "n, chunk, ignore",
    [(40, 16, ()), (40, 16, (0, 3, 17, 39)), (48, 16, tuple(range(16, 32))), (13, 1, (5,)), (13, 64, (2,)), (50, None, (7,))],
)
def test_value_and_hidden_gradient_match_the_float8_reference(n, chunk, ignore):
    h, w, t = _inputs(n, ignore=ignore)
    want = _value_and_grad(linear_cross_entropy_fp8_reference, h, w, t)
    got = _value_and_grad(fused_linear_cross_entropy_fp8, h, w, t, chunk_tokens=chunk)
    for actual, expected in zip(got, want, strict=True):
        assert expected.abs().sum() > 0
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_the_float8_head_is_not_the_bf16_head():
    """The comparison can fail: the float8 logits differ from the unquantized ones by more than
    the tolerance the parity test holds the op to (so that test checks the quantized path)."""
    from hone.kernels import linear_cross_entropy_reference

    h, w, t = _inputs(40, "rowwise")
    exact_weight = w.w_q.float() * w.w_scale  # the head the float8 copy was made from, rounded
    exact = linear_cross_entropy_reference(h.detach(), exact_weight, t)
    float8 = fused_linear_cross_entropy_fp8(h.detach(), w, t)
    assert not torch.allclose(float8, exact, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(float8, exact, rtol=5e-2, atol=0.0)  # but close: float8's rounding


def test_no_grad_evaluation_computes_the_value_only():
    h, w, t = _inputs(24, "rowwise")
    with torch.no_grad():
        loss = fused_linear_cross_entropy_fp8(h, w, t, chunk_tokens=8)
    torch.testing.assert_close(loss, linear_cross_entropy_fp8_reference(h.detach(), w, t), rtol=1e-5, atol=1e-6)
    assert not loss.requires_grad


def test_shapes_and_a_tensorwise_head_are_refused():
    h, w, t = _inputs(8)
    with pytest.raises(ValueError, match="shapes do not match"):
        fused_linear_cross_entropy_fp8(h[:, :16], w, t)
    h, w, t = _inputs(8, "tensorwise")
    with pytest.raises(ValueError, match="rowwise"):
        fused_linear_cross_entropy_fp8(h, w, t)


# opcheck's schema test compares float8 inputs with ops CPU float8 lacks ("mul_cpu_reduced_float");
# the fake implementation and the autograd registration are what compiled callers rely on
OPCHECKS = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")


def test_opcheck_passes_for_the_custom_op():
    h, w, t = _inputs(21, ignore=(2,))
    for need_grad in (True, False):
        args = (h, w.w_q, w.w_scale, w.wt_q, w.wt_scale, t, IGNORE, 8, "torch", need_grad)
        torch.library.opcheck(_fused_fp8_op, args, test_utils=OPCHECKS)


class _Model(nn.Module):
    """A trainable projection under the frozen float8 head: the loss's hidden states need a gradient."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.head = quantize_frozen_weight(torch.randn(VOCAB, HIDDEN) / HIDDEN**0.5, "rowwise")

    def forward(self, x, targets, loss_fn):
        return loss_fn(torch.tanh(self.proj(x)), self.head, targets)


def _fused_chunk16(h, w, t):
    return fused_linear_cross_entropy_fp8(h, w, t, chunk_tokens=16)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_fullgraph_without_graph_break_matches_the_reference():
    torch.manual_seed(0)
    model = _Model()
    x, targets = torch.randn(37, HIDDEN), torch.randint(0, VOCAB, (37,))
    targets[[5, 36]] = IGNORE
    (model(x, targets, linear_cross_entropy_fp8_reference) / 3).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    torch._dynamo.utils.counters.clear()
    loss = torch.compile(model, backend="aot_eager", fullgraph=True)(x, targets, _fused_chunk16)
    (loss / 3).backward()
    assert not torch._dynamo.utils.counters["graph_break"]
    for p, expected in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-6)
