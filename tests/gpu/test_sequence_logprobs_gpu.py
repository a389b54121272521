"""Per-sequence log-probabilities on CUDA at Qwen3-8B's head (hidden 4096, vocabulary 151,936,
bf16, 4096 tokens = two pairs of 1024-token sequences) against the plain float32 reference:
values and the gradients of the hidden states and of the head, for both per-chunk
implementations and under ``torch.compile(fullgraph=True)``. Skipped without a GPU."""

import pytest
import torch

from hone.kernels import sequence_logprobs, sequence_logprobs_reference, triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

N, H, V, SEGS = 4096, 4096, 151_936, 4


def _inputs():
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, H, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, V, (N,), device="cuda", generator=gen)
    segments = torch.arange(N, device="cuda") // (N // SEGS)
    segments[torch.arange(N, device="cuda") % (N // SEGS) < 200] = -1  # each sequence's prompt
    grad_out = torch.randn(SEGS, device="cuda", generator=gen) * 0.1
    return hidden, weight, targets, segments, grad_out


def _run(fn, hidden, weight, targets, segments, grad_out, **kwargs):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    if fn is sequence_logprobs_reference:
        out = fn(h, w, None, targets, segments, SEGS)
    else:
        out = fn(h, w, targets, segments, SEGS, **kwargs)
    (out * grad_out).sum().backward()
    return out.detach(), h.grad, w.grad


def _rel(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.fixture(scope="module")
def case():
    inputs = _inputs()
    return inputs, _run(sequence_logprobs_reference, *inputs)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_matches_reference_at_qwen3_8b_head(case, impl):
    if impl == "triton" and not triton_available(torch.device("cuda")):
        pytest.skip("triton is not installed")
    inputs, (ref, ref_gh, ref_gw) = case
    out, gh, gw = _run(sequence_logprobs, *inputs, impl=impl)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=1e-2)
    assert gh.dtype == gw.dtype == torch.bfloat16
    assert _rel(gh, ref_gh) < 1e-2 and _rel(gw, ref_gw) < 1e-2
    segments = inputs[3]
    assert gh[segments < 0].abs().max().item() == 0.0  # tokens of no sequence get no gradient


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_fullgraph_matches_reference(case):
    inputs, (ref, ref_gh, ref_gw) = case
    compiled = torch.compile(lambda h, w, t, s: sequence_logprobs(h, w, t, s, SEGS), fullgraph=True)
    out, gh, gw = _run(lambda h, w, t, s, num_segments: compiled(h, w, t, s), *inputs)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=1e-2)
    assert _rel(gh, ref_gh) < 1e-2 and _rel(gw, ref_gw) < 1e-2
