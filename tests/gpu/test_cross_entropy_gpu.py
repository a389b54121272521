"""Fused linear cross-entropy on CUDA at Qwen3-8B's loss shape (4096 tokens, hidden 4096,
vocabulary 151,936, bf16) against the plain float32 loss: value, gradient of the hidden
states and of the head (frozen and trained), for each per-chunk implementation, and under
``torch.compile(fullgraph=True)`` with Inductor. Skipped without a GPU."""

import pytest
import torch

from hone.kernels import fused_linear_cross_entropy, linear_cross_entropy_reference, triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

N, H, V = 4096, 4096, 151_936
SCALE = 1 / 4000  # the loss is divided by the window's tokens before backward


def _inputs():
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, H, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, V, (N,), device="cuda", generator=gen)
    targets[:100] = -100  # a prompt
    targets[1000:1800] = -100  # a whole chunk and more
    return hidden, weight, targets


def _run(fn, hidden, weight, targets, train_weight, **kwargs):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(train_weight)
    loss = fn(h, w, targets, **kwargs)
    (loss * SCALE).backward()
    return loss.detach(), h.grad, w.grad


@pytest.fixture(scope="module")
def case():
    hidden, weight, targets = _inputs()
    refs = {train: _run(linear_cross_entropy_reference, hidden, weight, targets, train) for train in (False, True)}
    return hidden, weight, targets, refs


def _rel(actual, expected):
    """Relative error in norm: the fair measure for bf16 tensors of millions of elements."""
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _check(result, ref, train_weight):
    loss, grad_hidden, grad_weight = result
    ref_loss, ref_grad_hidden, ref_grad_weight = ref
    assert torch.isfinite(loss) and abs(loss.item() - ref_loss.item()) <= 2e-3 * abs(ref_loss.item())
    assert grad_hidden.dtype == torch.bfloat16 and _rel(grad_hidden, ref_grad_hidden) < 1e-2
    assert grad_hidden[:100].abs().max().item() == 0.0  # ignored positions get no gradient
    if train_weight:
        assert grad_weight.dtype == torch.bfloat16 and _rel(grad_weight, ref_grad_weight) < 1e-2
    else:
        assert grad_weight is None


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen_head", "trained_head"])
@pytest.mark.parametrize("impl", ["torch", "compiled", "triton"])
def test_fused_matches_reference_at_qwen3_shape(case, impl, train_weight):
    if impl == "triton" and not triton_available("cuda"):
        pytest.skip("triton is not installed")
    hidden, weight, targets, refs = case
    result = _run(fused_linear_cross_entropy, hidden, weight, targets, train_weight, impl=impl)
    _check(result, refs[train_weight], train_weight)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fused_under_inductor_fullgraph_has_no_graph_break(case, impl):
    if impl == "triton" and not triton_available("cuda"):
        pytest.skip("triton is not installed")
    hidden, weight, targets, refs = case

    def loss_fn(h, w, t):
        return fused_linear_cross_entropy(h.contiguous(), w, t, impl=impl) * 1.0

    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(loss_fn, fullgraph=True)
    result = _run(compiled, hidden, weight, targets, True)
    assert not torch._dynamo.utils.counters["graph_break"]
    _check(result, refs[True], True)


def test_fused_peak_memory_is_far_below_the_reference(case):
    """The point of the kernel: the reference holds [N, V] logits in bf16 and float32 plus
    their gradient; the fused loss holds one chunk's (768 tokens here, about 0.9 GiB)."""
    hidden, weight, targets, _ = case
    peaks = {}
    for name, fn in (("reference", linear_cross_entropy_reference), ("fused", fused_linear_cross_entropy)):
        h = hidden.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(h, weight, targets).backward()  # frozen head, as under LoRA
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        del h
    logits_fp32 = N * V * 4
    assert peaks["reference"] > logits_fp32, peaks
    assert peaks["fused"] < logits_fp32 / 2, peaks
