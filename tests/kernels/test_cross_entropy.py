"""Fused linear cross-entropy against the plain float32 loss (CPU): value, gradient of the
hidden states and of the head, with ignored positions, ragged last chunks, a frozen head, a
tied head, a scaled loss, no_grad evaluation, bf16, and under ``torch.compile(fullgraph=True)``."""

import pytest
import torch
from torch import nn

from hone.kernels import (
    KernelUnavailableError,
    default_chunk_tokens,
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
)
from hone.kernels.cross_entropy import _fused_op

IGNORE = -100


def _inputs(n, hidden=24, vocab=67, dtype=torch.float32, ignore=(), seed=0, weight_grad=True):
    """Fresh random hidden states, head and targets; ``ignore`` lists positions set to -100."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dtype).requires_grad_(weight_grad)
    t = torch.randint(0, vocab, (n,), generator=gen)
    t[list(ignore)] = IGNORE
    return h, w, t


def _value_and_grads(loss_fn, h, w, t, scale=1.0, **kwargs):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(w.requires_grad)
    loss = loss_fn(h, w, t, **kwargs)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


def _assert_close(actual, expected, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "n, chunk, ignore",
    [
        (40, 16, ()),  # ragged last chunk (8 of 16), nothing ignored
        (40, 16, (0, 3, 17, 39)),  # some ignored rows, one in the ragged chunk
        (48, 16, tuple(range(16, 32))),  # a whole chunk ignored
        (13, 1, (5,)),  # one token per chunk
        (13, 64, (2, 4)),  # one chunk larger than the input
        (50, None, (7,)),  # the default chunk size
    ],
)
def test_fp32_value_and_both_gradients_match_reference(n, chunk, ignore):
    h, w, t = _inputs(n, ignore=ignore)
    ref = _value_and_grads(linear_cross_entropy_reference, h, w, t, scale=1 / 7)
    fused = _value_and_grads(fused_linear_cross_entropy, h, w, t, scale=1 / 7, chunk_tokens=chunk)
    for actual, expected in zip(fused, ref):
        assert expected is not None and expected.abs().sum() > 0
        _assert_close(actual, expected)


def test_all_positions_ignored_gives_zero_loss_and_zero_gradients():
    h, w, t = _inputs(20, ignore=range(20))
    loss, gh, gw = _value_and_grads(fused_linear_cross_entropy, h, w, t, chunk_tokens=8)
    assert loss.item() == 0.0 and gh.abs().max().item() == 0.0 and gw.abs().max().item() == 0.0


def test_the_comparison_catches_wrong_ignore_handling():
    """A fused loss that trained the ignored positions (as target 0) must fail the parity
    check: the tests above can fail."""
    h, w, t = _inputs(40, ignore=(1, 2, 30))
    ref = _value_and_grads(linear_cross_entropy_reference, h, w, t)
    wrong = _value_and_grads(fused_linear_cross_entropy, h, w, torch.where(t == IGNORE, 0, t), chunk_tokens=16)
    for actual, expected in zip(wrong, ref):
        with pytest.raises(AssertionError):
            _assert_close(actual, expected)


def test_frozen_head_gets_no_gradient_and_none_is_computed():
    h, w, t = _inputs(30, ignore=(4,), weight_grad=False)
    ref = _value_and_grads(linear_cross_entropy_reference, h, w, t, scale=0.25)
    fused = _value_and_grads(fused_linear_cross_entropy, h, w, t, scale=0.25, chunk_tokens=8)
    assert fused[2] is None
    _assert_close(fused[0], ref[0])
    _assert_close(fused[1], ref[1])
    _, grad_hidden, grad_weight = _fused_op(h.detach(), w, t, IGNORE, 8, "torch", True, False)
    assert grad_weight.numel() == 0 and grad_hidden.shape == h.shape


def test_no_grad_evaluation_computes_the_value_only():
    h, w, t = _inputs(30, ignore=(0,))
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h, w, t, chunk_tokens=8)
        _, grad_hidden, grad_weight = _fused_op(h, w, t, IGNORE, 8, "torch", False, False)
    assert grad_hidden.numel() == 0 and grad_weight.numel() == 0
    _assert_close(loss, linear_cross_entropy_reference(h, w, t).detach())


def test_tied_head_accumulates_both_uses_of_the_embedding():
    """Tied embeddings: the head is the input embedding, so its gradient sums the lookup's
    and the loss's shares."""
    vocab, hidden, n = 53, 16, 35
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (n,), generator=gen)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[[0, 9]] = IGNORE
    grads = []
    for loss_fn, kwargs in ((linear_cross_entropy_reference, {}), (fused_linear_cross_entropy, {"chunk_tokens": 16})):
        torch.manual_seed(0)
        emb = nn.Embedding(vocab, hidden)
        proj = nn.Linear(hidden, hidden)
        loss = loss_fn(torch.tanh(proj(emb(ids))), emb.weight, targets, **kwargs)
        (loss / 5).backward()
        grads.append((loss.detach(), emb.weight.grad, proj.weight.grad))
    for actual, expected in zip(grads[1], grads[0]):
        _assert_close(actual, expected)


def test_bf16_matches_reference_within_bf16_tolerance():
    h, w, t = _inputs(40, hidden=32, vocab=97, dtype=torch.bfloat16, ignore=(3, 33))
    ref = _value_and_grads(linear_cross_entropy_reference, h, w, t)
    fused = _value_and_grads(fused_linear_cross_entropy, h, w, t, chunk_tokens=16)
    assert fused[1].dtype == torch.bfloat16 and fused[2].dtype == torch.bfloat16
    for actual, expected in zip(fused, ref):
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_under_autocast_float32_operands_are_cast_like_the_reference_matmul(compiled):
    """Mixed precision: float32 trainable head and hidden states, bf16 compute. The fused loss
    must round like the reference under the same autocast and still give float32 gradients."""
    h, w, t = _inputs(40, hidden=32, vocab=97, ignore=(3,))
    fused = torch.compile(_fused_chunk16, backend="aot_eager", fullgraph=True) if compiled else _fused_chunk16
    results = []
    for fn in (linear_cross_entropy_reference, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_value_and_grads(fn, h, w, t))
    (value, grad_hidden, grad_weight), (ref_value, ref_grad_hidden, ref_grad_weight) = results[1], results[0]
    assert grad_hidden.dtype == torch.float32 and grad_weight.dtype == torch.float32
    # Same bf16 logits and gradient rows as the reference: equal to float32 precision (a
    # float32 matmul instead would be ~1e-4 off in value and ~5e-3 in the hidden gradient).
    _assert_close(value, ref_value)
    _assert_close(grad_hidden, ref_grad_hidden)
    # The head's gradient is summed over chunks of bf16 products: bf16 tolerance.
    torch.testing.assert_close(grad_weight, ref_grad_weight, rtol=1e-2, atol=1e-2)


def test_bf16_backward_scales_by_the_unrounded_grad_output():
    """Loss / 3001 (a window's token count): 1/3001 in bf16 is 0.17% too large. The stored
    gradients must be scaled in float32, so the fused gradients carry no such uniform bias."""
    h, w, t = _inputs(64, hidden=32, vocab=97, dtype=torch.bfloat16, ignore=(3,))
    ref = _value_and_grads(linear_cross_entropy_reference, h, w, t, scale=1 / 3001)
    fused = _value_and_grads(fused_linear_cross_entropy, h, w, t, scale=1 / 3001, chunk_tokens=16)
    for actual, expected in zip(fused[1:], ref[1:]):
        ratio = (actual.float() * expected.float()).sum() / (expected.float() ** 2).sum()
        assert abs(ratio.item() - 1) < 5e-4, ratio.item()


def test_default_chunk_tokens_keeps_float32_logits_within_budget():
    for vocab in (151_936, 128_256, 32_000):
        chunk = default_chunk_tokens(100_000, vocab)
        assert chunk % 128 == 0 and chunk * vocab * 4 <= 512 * 2**20
    assert default_chunk_tokens(100_000, 151_936) == 768
    assert default_chunk_tokens(100_000, 128_256) == 1024
    assert default_chunk_tokens(37, 151_936) == 48  # a small input is one chunk, 16-aligned
    assert default_chunk_tokens(10**6, 10**8) == 128  # never below one 128-token tile


def test_bad_arguments_raise():
    h, w, t = _inputs(8)
    with pytest.raises(KernelUnavailableError, match="not one of"):
        fused_linear_cross_entropy(h, w, t, impl="cuda")
    with pytest.raises(ValueError, match="share a dtype"):
        fused_linear_cross_entropy(h, w.detach().double(), t)
    with pytest.raises(ValueError, match="do not match"):
        fused_linear_cross_entropy(h, w, t[:5])


def test_triton_impl_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, t = _inputs(8)
    with pytest.raises(KernelUnavailableError, match="triton"):
        fused_linear_cross_entropy(h, w, t, impl="triton")


def test_opcheck_passes_for_the_custom_op():
    h, w, t = _inputs(21, ignore=(2,))
    torch.library.opcheck(_fused_op, (h, w, t, IGNORE, 8, "torch", True, True))
    torch.library.opcheck(_fused_op, (h, w.detach(), t, IGNORE, 8, "torch", True, False))


class _Head(nn.Module):
    """A projection and a head: the loss sees a hidden state that itself needs a gradient."""

    def __init__(self, hidden, vocab):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x, targets, loss_fn):
        return loss_fn(torch.tanh(self.proj(x)), self.head.weight, targets)


def _fused_chunk16(h, w, t):
    return fused_linear_cross_entropy(h, w, t, chunk_tokens=16)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fullgraph_without_graph_break_matches_eager_reference(backend):
    torch.manual_seed(0)
    model = _Head(16, 41)
    x = torch.randn(37, 16)
    targets = torch.randint(0, 41, (37,))
    targets[[5, 36]] = IGNORE

    ref_loss = model(x, targets, linear_cross_entropy_reference)
    (ref_loss / 3).backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    loss = compiled(x, targets, _fused_chunk16)
    (loss / 3).backward()
    assert not torch._dynamo.utils.counters["graph_break"]
    _assert_close(loss.detach(), ref_loss.detach())
    for p, expected in zip(model.parameters(), ref_grads):
        _assert_close(p.grad, expected)

    explanation = torch._dynamo.explain(model)(x, targets, _fused_chunk16)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
