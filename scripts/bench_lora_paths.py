"""What LoRA costs beside its base matmul, and what two other arithmetics of the same LoRA cost.

One llama3-8b decoder layer's seven projections at 8,192 tokens (seq 4096, micro-batch 2), LoRA
r16 on each, forward and backward, compiled (``fullgraph``) under bf16 autocast with float32
LoRA factors (hone's precision for LoRA), device time summed by the profiler over 20 iterations.
LoRA arithmetics:

- ``PEFT``: what PEFT's ``lora.Linear`` computes, ``base(x) + lora_B(lora_A(x.float())) * s``:
  the scaling multiplies the output-wide LoRA output (and, in the backward, its gradient);
- ``addmm``: one autograd function whose forward adds the LoRA output into the base's with
  ``addmm`` (cuBLAS's ``beta = 1`` epilogue) and whose backward adds the LoRA input gradient into
  the base's the same way (issue 29's first item through cuBLAS);
- ``hone lora_linear``: :func:`hone.kernels.lora_linear.lora_linear`, what hone's LoRA layers
  run: rank-side scaling and both sums in-place in the matmul epilogue (no copy of the addend);
- ``rank-side scaling``: one autograd function computing ``((x @ A.T) * s) @ B.T``, the scaling on
  the rank-wide ``[tokens, r]`` tensors in the forward and the backward (the same numbers where
  ``s`` is a power of two, as with hone's defaults alpha 32, r 16).

Each on a bf16 base and on hone's float8 frozen base (tensorwise), and LoRA alone. Run on a GPU:
``python scripts/bench_lora_paths.py``; session 31's H200 numbers are in
benchmarks/2026-11-29-h200-fp8.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from hone.kernels.fp8_linear import float8_mm, fp8_frozen_linear, quantize_frozen_weight
from hone.kernels.lora_linear import lora_linear

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


class _RankSideLora(torch.autograd.Function):
    """``((x @ A.T) * s) @ B.T``, differentiable in ``x``, ``A`` and ``B`` (factors in any dtype,
    computed in ``x``'s, their gradients returned in theirs)."""

    @staticmethod
    def forward(ctx, x, a, b, scaling):
        x2 = x.reshape(-1, x.shape[-1])
        a_, b_ = a.to(x.dtype), b.to(x.dtype)
        hs = (x2 @ a_.t()) * scaling
        ctx.save_for_backward(x2, hs, a_, b_)
        ctx.scaling, ctx.dtypes = scaling, (a.dtype, b.dtype)
        return (hs @ b_.t()).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        x2, hs, a_, b_ = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        g = (dy2 @ b_) * ctx.scaling
        da, db = (g.t() @ x2).to(ctx.dtypes[0]), (dy2.t() @ hs).to(ctx.dtypes[1])
        return (g @ a_).view(*dy.shape[:-1], -1), da, db, None


class _AddmmLora(torch.autograd.Function):
    """``base(x) + (x @ A.T) @ B.T * s`` with both sums in cuBLAS's epilogue; ``base`` is a float8
    weight (``FrozenFp8Weight``'s four tensors) or a bf16 one (``w`` alone)."""

    @staticmethod
    def forward(ctx, x, a, b, scaling, w, w_q, w_scale, wt_q, wt_scale):
        x2 = x.reshape(-1, x.shape[-1])
        a_, b_ = a.to(x.dtype), b.to(x.dtype)
        base = x2 @ w.t() if w is not None else float8_mm(x2, w_q, w_scale, fast_accum=True)
        h = x2 @ a_.t()
        ctx.save_for_backward(x2, h, a_, b_, w, wt_q, wt_scale)
        ctx.scaling, ctx.dtypes = scaling, (a.dtype, b.dtype)
        return torch.addmm(base, h, b_.t(), alpha=scaling).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        x2, h, a_, b_, w, wt_q, wt_scale = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        base = dy2 @ w if w is not None else float8_mm(dy2, wt_q, wt_scale, fast_accum=False)
        g = dy2 @ b_
        dx = torch.addmm(base, g, a_, alpha=ctx.scaling)
        da, db = ((g.t() @ x2) * ctx.scaling).to(ctx.dtypes[0]), ((dy2.t() @ h) * ctx.scaling).to(ctx.dtypes[1])
        return dx.view(*dy.shape[:-1], -1), da, db, None, None, None, None, None, None


def _device_ms(layer: Callable, inputs: dict[str, torch.Tensor], grads: list[torch.Tensor]) -> float:
    """Device milliseconds of one forward and backward of ``layer``, the kernels themselves
    (CPU-side ops carry their kernels' time too, so only CUDA events count)."""
    for _ in range(3):
        torch.autograd.backward(layer(inputs), grads)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERATIONS):
            torch.autograd.backward(layer(inputs), grads)
        torch.cuda.synchronize()
    events = prof.key_averages()
    return sum(e.device_time_total for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA") / ITERATIONS / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=[], help="run the variants whose name contains one of these")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    weights = {n: torch.randn(o, i, device=dev, dtype=torch.bfloat16) * 0.02 for n, (o, i) in SHAPES.items()}
    fp8 = {n: quantize_frozen_weight(w, "tensorwise") for n, w in weights.items()}
    lora_a = {n: (torch.randn(RANK, i, device=dev) * 0.02).requires_grad_() for n, (o, i) in SHAPES.items()}
    lora_b = {n: (torch.randn(o, RANK, device=dev) * 0.02).requires_grad_() for n, (o, i) in SHAPES.items()}

    def peft(n, x):
        return F.linear(F.linear(x.float(), lora_a[n]), lora_b[n]) * SCALING

    def rank_side(n, x):
        return _RankSideLora.apply(x, lora_a[n], lora_b[n], SCALING)

    def bf16_base(n, x):
        return x @ weights[n].t()

    def fp8_base(n, x):
        return fp8_frozen_linear(x, fp8[n])

    def addmm(n, x, base):
        q = fp8[n]
        args = (weights[n], None, None, None, None) if base is bf16_base else (None, q.w_q, q.w_scale, q.wt_q, q.wt_scale)
        return _AddmmLora.apply(x, lora_a[n], lora_b[n], SCALING, *args)

    def fused(n, x, base):
        return lora_linear(x, weights[n] if base is bf16_base else fp8[n], None, lora_a[n], lora_b[n], SCALING)

    variants = {}
    for base_name, base in (("bf16", bf16_base), ("fp8", fp8_base)):
        variants[f"{base_name} base, PEFT"] = lambda n, x, base=base: base(n, x) + peft(n, x)
        variants[f"{base_name} base, addmm"] = lambda n, x, base=base: addmm(n, x, base)
        variants[f"{base_name} base, hone lora_linear"] = lambda n, x, base=base: fused(n, x, base)
        variants[f"{base_name} base, rank-side scaling"] = lambda n, x, base=base: base(n, x) + rank_side(n, x)
        variants[f"{base_name} base alone"] = base
    variants["LoRA alone, PEFT"] = peft
    variants["LoRA alone, rank-side scaling"] = rank_side

    inputs = {k: torch.randn(TOKENS, d, device=dev, dtype=torch.bfloat16).requires_grad_() for k, d in WIDTH.items()}
    grads = [torch.randn(TOKENS, SHAPES[n][0], device=dev, dtype=torch.bfloat16) for n in SHAPES]
    for name, projection in variants.items():
        if args.only and not any(part in name for part in args.only):
            continue

        def layer(xs, projection=projection):
            with torch.autocast("cuda", torch.bfloat16):
                return [projection(n, xs[INPUT_OF[n]]).to(torch.bfloat16) for n in SHAPES]

        torch._dynamo.reset()  # ten variants of one function would pass Dynamo's recompile limit
        ms = _device_ms(torch.compile(layer, fullgraph=True), inputs, grads)
        print(f"{name:32s} {ms:6.3f} ms of device time per layer, forward and backward ({32 * ms:6.1f} ms for 32 layers)")


if __name__ == "__main__":
    main()
