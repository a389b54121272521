"""Per-sequence log-probabilities from the last hidden states against the plain float32
reference (CPU): value and gradients of the hidden states, the head and its bias, with ignored
targets, tokens of no sequence, ragged chunks, a sequence cut by a chunk boundary, empty
sequences, a frozen head, bf16, autocast, opcheck and ``torch.compile(fullgraph=True)``."""

import importlib

import pytest
import torch
from torch import nn

from hone.kernels import KernelUnavailableError
from hone.kernels.cross_entropy import DEFAULT_LOGITS_BUDGET_BYTES, default_chunk_tokens
from hone.kernels.sequence_logprobs import (
    _backward_op,
    _forward_op,
    segment_token_counts,
    sequence_logprobs,
    sequence_logprobs_reference,
)

IGNORE = -100


def _inputs(n=45, hidden=24, vocab=67, segs=5, dtype=torch.float32, seed=0, bias=True, weight_grad=True):
    """Fresh random inputs: ``segs`` sequences of random lengths laid out one after another (as a
    packed micro-batch), a few tokens of no sequence (-1) between them and a few ignored targets."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dtype).requires_grad_(weight_grad)
    b = (torch.randn(vocab, generator=gen) * 0.1).to(dtype).requires_grad_(weight_grad) if bias else None
    t = torch.randint(0, vocab, (n,), generator=gen)
    s = torch.sort(torch.randint(0, segs, (n,), generator=gen)).values
    s[torch.rand(n, generator=gen) < 0.1] = -1
    t[torch.rand(n, generator=gen) < 0.1] = IGNORE
    return h, w, b, t, s


def _value_and_grads(fn, h, w, b, t, s, segs, weights, **kwargs):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(w.requires_grad)
    b = None if b is None else b.detach().clone().requires_grad_(b.requires_grad)
    if fn is sequence_logprobs_reference:
        out = fn(h, w, b, t, s, segs, **kwargs)
    else:
        out = fn(h, w, t, s, segs, bias=b, **kwargs)
    (out * weights).sum().backward()
    return out.detach(), h.grad, w.grad, None if b is None else b.grad


def _close(actual, expected, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "n, chunk, bias, seed",
    [
        (45, 16, True, 0),  # ragged last chunk, sequences cut by chunk boundaries
        (45, 16, False, 1),  # no bias
        (13, 1, True, 2),  # one token per chunk
        (13, 64, True, 3),  # one chunk larger than the input
        (50, None, False, 4),  # the default chunk size
    ],
)
def test_fp32_value_and_all_gradients_match_reference(n, chunk, bias, seed):
    segs = 5
    h, w, b, t, s = _inputs(n, segs=segs, seed=seed, bias=bias)
    weights = torch.randn(segs, generator=torch.Generator().manual_seed(seed + 100))  # a per-sequence upstream gradient
    ref = _value_and_grads(sequence_logprobs_reference, h, w, b, t, s, segs, weights)
    fused = _value_and_grads(sequence_logprobs, h, w, b, t, s, segs, weights, chunk_tokens=chunk)
    assert ref[0].shape == (segs,) and ref[0].dtype == torch.float32
    for actual, expected in zip(fused, ref):
        if expected is None:
            assert actual is None
            continue
        assert expected.abs().sum() > 0
        _close(actual, expected)


def test_reference_equals_per_sequence_log_softmax_sums():
    """The reference itself, against a direct loop over sequences."""
    h, w, b, t, s = _inputs(30, segs=4, seed=7)
    out = sequence_logprobs_reference(h, w, b, t, s, 6)  # segments 4 and 5 are empty
    logp = torch.log_softmax((h @ w.T + b).float(), -1)
    for seg in range(6):
        rows = [i for i in range(30) if s[i] == seg and t[i] != IGNORE]
        expected = sum((logp[i, t[i]] for i in rows), torch.tensor(0.0))
        _close(out[seg], expected)
    assert out[4].item() == 0.0 and out[5].item() == 0.0
    counts = segment_token_counts(t, s, 6)
    assert counts.tolist() == [float(sum(1 for i in range(30) if s[i] == seg and t[i] != IGNORE)) for seg in range(6)]


def test_the_comparison_catches_counting_tokens_of_no_sequence():
    """Treating segment -1 as segment 0 must fail the parity check (the tests above can fail)."""
    h, w, b, t, s = _inputs(40, segs=3, seed=5)
    s[0] = -1
    weights = torch.ones(3)
    ref = _value_and_grads(sequence_logprobs_reference, h, w, b, t, s, 3, weights)
    t = t.clone()
    t[0] = 3
    wrong = _value_and_grads(sequence_logprobs, h, w, b, t, s.clamp(min=0), 3, weights, chunk_tokens=8)
    with pytest.raises(AssertionError):
        _close(wrong[0], ref[0])


def test_frozen_head_gets_no_gradient():
    h, w, b, t, s = _inputs(30, weight_grad=False)
    weights = torch.randn(5)
    ref = _value_and_grads(sequence_logprobs_reference, h, w, b, t, s, 5, weights)
    out, gh, gw, gb = _value_and_grads(sequence_logprobs, h, w, b, t, s, 5, weights, chunk_tokens=8)
    assert gw is None and gb is None
    _close(out, ref[0])
    _close(gh, ref[1])


def test_no_grad_evaluation():
    h, w, b, t, s = _inputs(30)
    with torch.no_grad():
        out = sequence_logprobs(h, w, t, s, 5, bias=b, chunk_tokens=8)
    assert not out.requires_grad
    _close(out, sequence_logprobs_reference(h, w, b, t, s, 5).detach())


def test_bf16_is_within_bf16_tolerance():
    h, w, b, t, s = _inputs(40, hidden=32, vocab=97, dtype=torch.bfloat16)
    weights = torch.randn(5)
    ref = _value_and_grads(sequence_logprobs_reference, h, w, b, t, s, 5, weights)
    fused = _value_and_grads(sequence_logprobs, h, w, b, t, s, 5, weights, chunk_tokens=16)
    assert fused[1].dtype == fused[2].dtype == fused[3].dtype == torch.bfloat16
    for actual, expected in zip(fused, ref):
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_under_autocast_operands_are_cast_like_the_reference():
    h, w, b, t, s = _inputs(40, hidden=32, vocab=97)
    weights = torch.randn(5)
    results = []
    for fn, kwargs in ((sequence_logprobs_reference, {}), (sequence_logprobs, {"chunk_tokens": 16})):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_value_and_grads(fn, h, w, b, t, s, 5, weights, **kwargs))
    ref, fused = results
    assert all(g.dtype == torch.float32 for g in fused[1:])
    _close(fused[0], ref[0])
    _close(fused[1], ref[1], rtol=1e-4, atol=1e-5)
    for actual, expected in zip(fused[2:], ref[2:]):
        torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2)


def test_bad_arguments_raise():
    h, w, b, t, s = _inputs(8)
    with pytest.raises(ValueError, match="do not match"):
        sequence_logprobs(h, w, t[:5], s, 5)
    with pytest.raises(ValueError, match="bias must be"):
        sequence_logprobs(h, w, t, s, 5, bias=b[:3])
    with pytest.raises(ValueError, match="share a dtype"):
        sequence_logprobs(h, w.detach().double(), t, s, 5)
    with pytest.raises(ValueError, match="chunk_tokens"):
        sequence_logprobs(h, w, t, s, 5, chunk_tokens=0)
    with pytest.raises(KernelUnavailableError, match="not one of"):
        sequence_logprobs(h, w, t, s, 5, impl="cuda")


def test_triton_impl_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, b, t, s = _inputs(8)
    with pytest.raises(KernelUnavailableError, match="triton"):
        sequence_logprobs(h, w, t, s, 5, impl="triton")


def test_opcheck_passes_for_both_custom_ops():
    h, w, b, t, s = _inputs(21)
    torch.library.opcheck(_forward_op, (h, w, b, t, s, 5, IGNORE, 8, "torch"))
    torch.library.opcheck(_forward_op, (h, w.detach(), None, t, s, 5, IGNORE, 8, "torch"))
    g = torch.randn(5)
    torch.library.opcheck(_backward_op, (g, h.detach(), w.detach(), b.detach(), t, s, IGNORE, 8, "torch", True, True, True))
    torch.library.opcheck(_backward_op, (g, h.detach(), w.detach(), None, t, s, IGNORE, 8, "torch", True, False, False))


class _Head(nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=True)

    def forward(self, x, targets, segments, fn):
        out = fn(torch.tanh(self.proj(x)), self.head.weight, self.head.bias, targets, segments)
        return -torch.nn.functional.logsigmoid(out[0::2] - out[1::2]).sum()  # a DPO-like objective


def _reference(h, w, b, t, s):
    return sequence_logprobs_reference(h, w, b, t, s, 4)


def _fused(h, w, b, t, s):
    return sequence_logprobs(h, w, t, s, 4, bias=b, chunk_tokens=16)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fullgraph_without_graph_break_matches_eager_reference(backend):
    torch.manual_seed(0)
    model = _Head(16, 41)
    x = torch.randn(37, 16)
    targets = torch.randint(0, 41, (37,))
    targets[[5, 36]] = IGNORE
    segments = torch.sort(torch.randint(0, 4, (37,))).values
    segments[:3] = -1

    ref = model(x, targets, segments, _reference)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    loss = compiled(x, targets, segments, _fused)
    loss.backward()
    assert not torch._dynamo.utils.counters["graph_break"]
    _close(loss.detach(), ref.detach())
    for p, expected in zip(model.parameters(), ref_grads):
        _close(p.grad, expected)


@pytest.mark.parametrize("trained", [True, False])
def test_a_frozen_head_takes_chunks_of_half_the_logits_budget(monkeypatch, trained):
    """The forward's chunk is alive at the step's peak; with no head gradient to accumulate a
    smaller chunk costs only launches, so a frozen head gets half the budget. Equal values
    either way (only the accumulation order of the per-segment sums differs)."""
    module = importlib.import_module("hone.kernels.sequence_logprobs")  # the package exports a function of that name
    seen = []
    real = module._forward_op
    monkeypatch.setattr(module, "_forward_op", lambda *args: seen.append(args[7]) or real(*args))
    vocab = DEFAULT_LOGITS_BUDGET_BYTES // (4 * 256)  # the default budget holds 256 tokens of it, half holds 128
    h, w, b, t, s = _inputs(300, hidden=2, vocab=vocab, segs=4, weight_grad=trained)
    value = sequence_logprobs(h, w, t, s, 4, bias=b)
    expected = 256 if trained else 128
    assert seen == [expected] and default_chunk_tokens(300, vocab) == 256
    _close(value, sequence_logprobs_reference(h, w, b, t, s, 4))
