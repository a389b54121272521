"""Is the LoRA output cheaper added by cuBLAS's ``beta = 1`` epilogue (``addmm``)? (issue 29, item 1)

One llama3-8b decoder layer's seven projections at 8,192 tokens, forward and backward, compiled
(``fullgraph``), device time summed by the profiler over 20 iterations. Four variants:

- ``fp8``: hone's float8 frozen base plus PEFT's LoRA arithmetic (``base(x) + B(A(x)) * s``);
- ``fp8, addmm``: one autograd function whose forward adds the LoRA output into the base's with
  ``addmm`` and whose backward adds the LoRA input gradient into the base's the same way;
- ``bf16`` and ``bf16, addmm``: the same on a bf16 base.

Run on a GPU: ``python scripts/bench_lora_addmm.py``. Session 31's H200 numbers are in
benchmarks/2026-11-29-h200-fp8.md.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from hone.kernels.fp8_linear import float8_mm, fp8_frozen_linear, quantize_frozen_weight

TOKENS, HIDDEN, INTERMEDIATE, KV, RANK, SCALING = 8192, 4096, 14336, 1024, 16, 2.0
SHAPES = {
    "q": (HIDDEN, HIDDEN),
    "k": (KV, HIDDEN),
    "v": (KV, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate": (INTERMEDIATE, HIDDEN),
    "up": (INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}
INPUT_OF = {"q": "x", "k": "x", "v": "x", "o": "attn", "gate": "h", "up": "h", "down": "act"}
WIDTH = {"x": HIDDEN, "attn": HIDDEN, "h": HIDDEN, "act": INTERMEDIATE}
ITERATIONS = 20


class _Fp8LoraAddmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_q, w_scale, wt_q, wt_scale, a, b, scaling):
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ a.t()
        y = torch.addmm(float8_mm(x2, w_q, w_scale, fast_accum=True), h, b.t(), alpha=scaling)
        ctx.save_for_backward(x2, h, wt_q, wt_scale, a, b)
        ctx.scaling = scaling
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        x2, h, wt_q, wt_scale, a, b = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        g = dy2 @ b
        dx = torch.addmm(float8_mm(dy2, wt_q, wt_scale, fast_accum=False), g, a, alpha=ctx.scaling)
        return dx.view(*dy.shape[:-1], -1), None, None, None, None, (g.t() @ x2) * ctx.scaling, (dy2.t() @ h) * ctx.scaling, None


class _Bf16LoraAddmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, a, b, scaling):
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ a.t()
        y = torch.addmm(x2 @ w.t(), h, b.t(), alpha=scaling)
        ctx.save_for_backward(x2, h, w, a, b)
        ctx.scaling = scaling
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        x2, h, w, a, b = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        g = dy2 @ b
        dx = torch.addmm(dy2 @ w, g, a, alpha=ctx.scaling)
        return dx.view(*dy.shape[:-1], -1), None, (g.t() @ x2) * ctx.scaling, (dy2.t() @ h) * ctx.scaling, None


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    weights = {n: torch.randn(o, i, device=dev, dtype=torch.bfloat16) * 0.02 for n, (o, i) in SHAPES.items()}
    fp8 = {n: quantize_frozen_weight(w, "tensorwise") for n, w in weights.items()}
    lora_a = {n: (torch.randn(RANK, i, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_() for n, (o, i) in SHAPES.items()}
    lora_b = {n: (torch.randn(o, RANK, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_() for n, (o, i) in SHAPES.items()}

    def lora(n, x):
        return (x @ lora_a[n].t()) @ lora_b[n].t() * SCALING

    def fp8_peft(n, x):
        return fp8_frozen_linear(x, fp8[n]) + lora(n, x)

    def fp8_addmm(n, x):
        w = fp8[n]
        return _Fp8LoraAddmm.apply(x, w.w_q, w.w_scale, w.wt_q, w.wt_scale, lora_a[n], lora_b[n], SCALING)

    def bf16_peft(n, x):
        return x @ weights[n].t() + lora(n, x)

    def bf16_addmm(n, x):
        return _Bf16LoraAddmm.apply(x, weights[n], lora_a[n], lora_b[n], SCALING)

    inputs = {k: torch.randn(TOKENS, d, device=dev, dtype=torch.bfloat16).requires_grad_() for k, d in WIDTH.items()}
    grads = [torch.randn(TOKENS, SHAPES[n][0], device=dev, dtype=torch.bfloat16) for n in SHAPES]
    for name, projection in [("fp8", fp8_peft), ("fp8, addmm", fp8_addmm), ("bf16", bf16_peft), ("bf16, addmm", bf16_addmm)]:
        layer = torch.compile(lambda xs, p=projection: [p(n, xs[INPUT_OF[n]]) for n in SHAPES], fullgraph=True)
        for _ in range(3):
            torch.autograd.backward(layer(inputs), grads)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(ITERATIONS):
                torch.autograd.backward(layer(inputs), grads)
            torch.cuda.synchronize()
        kernels = [  # the kernels themselves (CPU-side ops carry their kernels' time too)
            (e.device_time_total / ITERATIONS / 1e3, e.count // ITERATIONS, e.key)
            for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type.name == "CUDA"
        ]
        total = sum(t for t, _, _ in kernels)
        print(f"{name:12s} {total:.3f} ms of device time per layer, forward and backward ({32 * total:.1f} ms for 32 layers)")
        for ms, count, key in sorted(kernels, reverse=True)[:6]:
            print(f"    {ms:7.3f} ms  x{count:<3d} {key[:90]}")


if __name__ == "__main__":
    main()
