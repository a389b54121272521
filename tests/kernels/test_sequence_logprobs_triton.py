"""``sequence_logprobs(impl="triton")`` on CPU under Triton's interpreter, against the plain
reference: value and the gradients of the hidden states, the head and its bias, in fp32 and
bf16, with ignored targets, tokens of no sequence and ragged chunks. The checks run in one
subprocess (``TRITON_INTERPRET=1`` must be set before triton is imported); skipped where triton
is not installed (CPU-only torch wheels do not bring it)."""

import importlib.util

import pytest
from interpreted import run_interpreted

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (CPU-only torch); the GPU tests cover it"
)

_CHECKS = r"""
import json
import torch
from hone.kernels import sequence_logprobs, sequence_logprobs_reference

out = {}
gen = torch.Generator().manual_seed(0)
n, hidden, vocab, segs = 45, 16, 57, 5
for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    h = torch.randn(n, hidden, generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) / 4).to(dtype)
    b = (torch.randn(vocab, generator=gen) / 10).to(dtype)
    t = torch.randint(0, vocab, (n,), generator=gen)
    s = torch.sort(torch.randint(0, segs, (n,), generator=gen)).values
    t[[0, 5, 30]] = -100
    s[[2, 17, 44]] = -1
    g = torch.randn(segs, generator=gen)
    results = []
    for fn in ("reference", "triton"):
        hh, ww, bb = (x.clone().requires_grad_(True) for x in (h, w, b))
        if fn == "reference":
            value = sequence_logprobs_reference(hh, ww, bb, t, s, segs)
        else:
            value = sequence_logprobs(hh, ww, t, s, segs, bias=bb, chunk_tokens=16, impl="triton")
        (value * g).sum().backward()
        results.append([x.float() for x in (value.detach(), hh.grad, ww.grad, bb.grad)])
    out[name] = [((a - e).abs().max() / e.abs().max()).item() for a, e in zip(results[1], results[0])]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(["-c", _CHECKS])


def test_triton_impl_fp32_matches_reference(interpreted):
    assert all(err < 1e-5 for err in interpreted["fp32"]), interpreted["fp32"]


def test_triton_impl_bf16_is_within_bf16_tolerance(interpreted):
    assert all(err < 2e-2 for err in interpreted["bf16"]), interpreted["bf16"]
