"""Checks of the gated activation over a buffer's first rows (hone.kernels.gated_rows), one case per run.

Run as ``python tests/kernels/gated_rows_checks.py CASE`` with ``TRITON_INTERPRET=1`` set (before
triton is imported, hence another process: tests/interpreted.py's, from tests/kernels/test_gated_rows.py);
prints ``RESULT {json}``. The GPU test imports :func:`kernel_errors` too.
"""

from __future__ import annotations

import json
import sys

import torch

from hone.kernels.gated_rows import gated_rows, gated_rows_reference
from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE

LAYOUTS = {"qwen": QWEN3_MOE, "gptoss": GPT_OSS}


def kernel_errors(layout_name: str, dtype: torch.dtype, rows: int, inter: int, count: int, seed: int, device="cpu") -> dict:
    """Largest relative error, over the rows below ``count``, of the op's output and its input
    gradient against the float32 reference on the same inputs (fresh random values, several times the clamp limit, so the
    clamped layout's bounds are crossed on both sides)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    layout = LAYOUTS[layout_name]
    gate_up = (torch.randn(rows, 2 * inter, generator=gen, device=device) * 4).to(dtype)
    grad = torch.randn(rows, inter, generator=gen, device=device).to(dtype)
    count_t = torch.tensor([count], device=device)

    def run(fn, dtype):
        leaf = gate_up.detach().to(dtype).clone().requires_grad_(True)
        out = fn(leaf, count_t, layout)
        out.backward(grad.to(dtype))
        return out[:count].float(), leaf.grad[:count].float()

    # the reference in float32 from the same inputs: in bf16 it rounds after every op, the kernel once
    (out, d_in), (want, want_d) = run(gated_rows, dtype), run(gated_rows_reference, torch.float32)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0

    return {"out": rel(out, want), "grad": rel(d_in, want_d)}


def check_kernel() -> dict:
    """Both layouts, float32 and bfloat16, the count at 0, inside a block, at a block's edge and at the end."""
    errors = {}
    for layout in LAYOUTS:
        for dtype in (torch.float32, torch.bfloat16):
            for count in (0, 45, 64, 77):
                errors[f"{layout}-{dtype}-{count}"] = kernel_errors(layout, dtype, 77, 136, count, seed=count + 1)
    return errors


def check_opcheck() -> dict:
    """``torch.library.opcheck`` of both ops with every row real (rows past the count are left
    unwritten, which no two calls agree on)."""
    gate_up = torch.randn(40, 2 * 24) * 4
    grad = torch.randn(40, 24)
    count = torch.tensor([40])
    results = {}
    for name, op, args in (
        (
            "forward",
            torch.ops.hone.gated_rows.default,
            (gate_up.clone().requires_grad_(True), count, True, "clamped_swiglu", 1.702, 7.0),
        ),
        ("backward", torch.ops.hone.gated_rows_backward.default, (grad, gate_up, count, False, "silu", 1.702, 7.0)),
    ):
        torch.library.opcheck(op, args)
        results[name] = "ok"
    return results


def check_compile() -> dict:
    """``torch.compile(fullgraph=True)`` through the op, forward and backward, against eager."""
    layout = GPT_OSS
    gate_up = torch.randn(50, 2 * 40) * 4
    count = torch.tensor([37])
    grad = torch.randn(50, 40)

    def step(fn):
        leaf = gate_up.clone().requires_grad_(True)
        out = fn(leaf, count)
        out.backward(grad)
        return out[:37], leaf.grad[:37]

    def f(x, c):
        return gated_rows(x, c, layout) * 2

    eager = step(f)
    torch._dynamo.reset()
    compiled = step(torch.compile(f, fullgraph=True, backend="aot_eager"))
    return {"out": float((compiled[0] - eager[0]).abs().max()), "grad": float((compiled[1] - eager[1]).abs().max())}


CHECKS = {"kernel": check_kernel, "opcheck": check_opcheck, "compile": check_compile}


if __name__ == "__main__":
    print("RESULT " + json.dumps(CHECKS[sys.argv[1]]()))
