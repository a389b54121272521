"""The gated activation over a buffer's first rows (hone.kernels.gated_rows): the Triton kernel
against the plain-PyTorch reference on the rows below the count, forward and the input
gradient, both layouts (qwen3-moe's halves with SiLU, gpt-oss's interleaved clamped SwiGLU),
float32 (1e-5) and bfloat16 (1e-2), the count at 0, mid-block, a block's edge and every row;
opcheck and ``torch.compile(fullgraph=True)``. Kernel cases run under Triton's interpreter in
another process (tests/kernels/gated_rows_checks.py), skipped without triton; tests/gpu covers
the GPU. Without the interpreter the op computes every row with the reference, checked here."""

from pathlib import Path

import pytest
import torch
from interpreted import needs_triton, run_interpreted

from hone.kernels.gated_rows import gated_rows, gated_rows_reference
from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE, ExpertsLayout

CHECKS = Path(__file__).with_name("gated_rows_checks.py")


@needs_triton
def test_kernel_equals_the_reference_on_the_counted_rows():
    errors = run_interpreted([str(CHECKS), "kernel"])
    assert len(errors) == 16
    for case, err in errors.items():
        tolerance = 1e-5 if "float32" in case else 1e-2
        assert err["out"] <= tolerance and err["grad"] <= tolerance, (case, err)


@needs_triton
def test_ops_pass_opcheck():
    assert run_interpreted([str(CHECKS), "opcheck"]) == {"forward": "ok", "backward": "ok"}


@needs_triton
def test_compile_fullgraph_equals_eager():
    errors = run_interpreted([str(CHECKS), "compile"])
    assert errors["out"] <= 1e-6 and errors["grad"] <= 1e-6, errors


@pytest.mark.parametrize("layout", [QWEN3_MOE, GPT_OSS], ids=["qwen", "gptoss"])
def test_without_triton_every_row_is_the_reference_forward_and_backward(layout):
    gate_up = torch.randn(9, 12, dtype=torch.float64) * 4
    grad = torch.randn(9, 6, dtype=torch.float64)
    count = torch.tensor([5])
    results = []
    for fn in (gated_rows, gated_rows_reference):
        leaf = gate_up.clone().requires_grad_(True)
        out = fn(leaf, count, layout)
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    (out, d_in), (want, want_d) = results
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d_in, want_d, rtol=1e-12, atol=1e-12)


def test_an_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="relu"):
        gated_rows(torch.randn(2, 4), torch.tensor([2]), ExpertsLayout(transposed=False, interleaved=False, activation="relu"))
