"""The Triton softmax-gradient kernel and the fused loss's ``impl="triton"`` on CPU, under
Triton's interpreter. ``TRITON_INTERPRET=1`` must be set before triton is imported, so the
checks run in one subprocess that reports its measured differences as JSON; skipped where
triton is not installed (CPU-only torch wheels do not bring it)."""

import pytest
from interpreted import needs_triton, run_interpreted

pytestmark = needs_triton

_CHECKS = r"""
import json
import torch
from hone.kernels import fused_linear_cross_entropy, linear_cross_entropy_reference
from hone.kernels.cross_entropy import _softmax_grad_torch
from hone.kernels.cross_entropy_triton import cross_entropy_softmax_grad_

out = {}
gen = torch.Generator().manual_seed(0)

# The kernel alone: 6 rows of 100 logits in blocks of 32 (the last block ragged), row 2 ignored.
for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    logits = torch.randn(6, 100, generator=gen).to(dtype)
    targets = torch.randint(0, 100, (6,), generator=gen)
    targets[2] = -100
    grad_ref, loss_ref = _softmax_grad_torch(logits.clone(), targets, -100)
    grad = logits.clone()
    loss = cross_entropy_softmax_grad_(grad, targets, -100, 32)
    out[f"kernel_{name}"] = {
        "loss": (loss - loss_ref).abs().max().item(),
        "grad": (grad.float() - grad_ref.float()).abs().max().item(),
        "ignored_row": grad[2].abs().max().item(),
        "dtype": str(grad.dtype),
    }

# The op's registration (schema, fake implementation, mutation) as torch.library checks it.
try:
    logits, targets = torch.randn(5, 40, generator=gen), torch.tensor([1, -100, 3, 39, 0])
    torch.library.opcheck(cross_entropy_softmax_grad_, (logits, targets, -100, 16))
    out["opcheck"] = "ok"
except Exception as exc:  # reported to the test, which prints it
    out["opcheck"] = repr(exc)

# The whole fused loss with impl="triton" against the reference, fp32, ragged and ignored chunks.
n, hidden, vocab = 40, 16, 57
h = torch.randn(n, hidden, generator=gen)
w = torch.randn(vocab, hidden, generator=gen) / 4
t = torch.randint(0, vocab, (n,), generator=gen)
t[[0, 5]] = -100
t[16:32] = -100
results = []
for fn, kwargs in ((linear_cross_entropy_reference, {}), (fused_linear_cross_entropy, {"chunk_tokens": 16, "impl": "triton"})):
    hh = h.clone().requires_grad_(True)
    ww = w.clone().requires_grad_(True)
    loss = fn(hh, ww, t, **kwargs)
    (loss / 7).backward()
    results.append((loss.detach(), hh.grad, ww.grad))
out["fused_fp32"] = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(results[1], results[0])]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(["-c", _CHECKS])


def test_kernel_fp32_matches_torch_step(interpreted):
    r = interpreted["kernel_fp32"]
    assert r["loss"] < 1e-5 and r["grad"] < 1e-6 and r["ignored_row"] == 0.0


def test_kernel_bf16_writes_gradient_in_place_in_bf16(interpreted):
    r = interpreted["kernel_bf16"]
    assert r["dtype"] == "torch.bfloat16"
    assert r["loss"] < 1e-5  # both read the same bf16 logits and reduce in float32
    assert r["grad"] <= 2**-8  # one bf16 rounding of values in [-1, 1]
    assert r["ignored_row"] == 0.0


def test_kernel_op_passes_opcheck(interpreted):
    assert interpreted["opcheck"] == "ok"


def test_fused_triton_impl_matches_reference(interpreted):
    value, grad_hidden, grad_weight = interpreted["fused_fp32"]
    assert value < 1e-5 and grad_hidden < 1e-5 and grad_weight < 1e-5
