"""Micro-benchmark: fused linear cross-entropy vs the plain float32 loss on one GPU.

Not a test. Times forward+backward (CUDA events, warm-up, median of ``--repeats``) and the peak
memory above the inputs (``torch.cuda.max_memory_allocated``) of each variant, at Qwen3-8B's
head (hidden 4096, vocabulary 151,936, bf16), with the head frozen (LoRA) and trained (full
fine-tune; the float8 head, ``performance.fp8_head``, frozen only), and prints a markdown
table. Each variant runs in its own try/except: an OOM or an error is a row, not the end of
the run. The ``loss rel err`` column is the loss's relative
difference from the eager reference of the same row group.

    PYTHONPATH=$PWD python scripts/bench_fused_ce.py            # all variants, ~2-3 min on an H100
    PYTHONPATH=$PWD python scripts/bench_fused_ce.py --tokens 8192 --variants fused-torch fused-triton
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from hone.kernels import fused_linear_cross_entropy, linear_cross_entropy_reference, triton_available


def _variants(chunk_tokens: int | None) -> dict[str, Callable[[], Callable]]:
    """Name -> factory of the loss function (factories so each compiled variant starts fresh)."""

    def fused(impl):
        return lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_tokens=chunk_tokens, impl=impl)

    def compiled(fn):
        torch._dynamo.reset()
        return torch.compile(fn, fullgraph=True, dynamic=False)

    def float8_head():
        """The frozen head quantized once (as performance.fp8_head does when the loss is built)."""
        from hone.kernels.cross_entropy_fp8 import fused_linear_cross_entropy_fp8
        from hone.kernels.fp8_linear import quantize_frozen_weight

        quantized = {}

        def loss(h, w, t):  # frozen heads only: the variant loop skips a trained one
            if w.data_ptr() not in quantized:
                quantized.clear()
                quantized[w.data_ptr()] = quantize_frozen_weight(w.detach(), "rowwise")
            return fused_linear_cross_entropy_fp8(h, quantized[w.data_ptr()], t, chunk_tokens=chunk_tokens, impl="triton")

        return loss

    return {
        "reference eager": lambda: linear_cross_entropy_reference,
        "reference compiled": lambda: compiled(linear_cross_entropy_reference),
        "fused-torch": lambda: fused("torch"),
        "fused-torch in compiled graph": lambda: compiled(fused("torch")),
        "fused-compiled (inductor chunk step)": lambda: fused("compiled"),
        "fused-triton": lambda: fused("triton"),
        "fused-triton, float8 head (frozen only)": float8_head,
    }


def _measure(fn, hidden, weight, targets, train_weight: bool, warmup: int, repeats: int):
    """(median ms, peak MiB above the inputs, loss value, first-call seconds incl. compile)."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(train_weight)

    def step():
        h.grad = None
        w.grad = None
        loss = fn(h, w, targets)
        loss.backward()
        return loss

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    h.grad = None
    w.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    value = loss.item()
    del h, w, loss
    return statistics.median(times), peak, value, first_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 24576])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: hone.kernels.default_chunk_tokens")
    parser.add_argument("--variants", nargs="+", default=None, help="names from the table (default: all)")
    parser.add_argument("--head", choices=["frozen", "trained", "both"], default="both")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    factories = _variants(args.chunk_tokens)
    names = args.variants or list(factories)
    unknown = [n for n in names if n not in factories]
    if unknown:
        print(f"unknown variants {unknown}; known: {list(factories)}", file=sys.stderr)
        return 2
    heads = {"frozen": [False], "trained": [True], "both": [False, True]}[args.head]
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton_version}, "
        f"H={args.hidden}, V={args.vocab}, bf16, chunk_tokens={args.chunk_tokens or 'default'}, "
        f"median of {args.repeats} after {args.warmup} warm-up\n"
    )
    print("| tokens | head | variant | fwd+bwd ms | peak MiB above inputs | loss rel err | first call s |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: |")
    began = time.perf_counter()
    for n in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(n)
        hidden = torch.randn(n, args.hidden, device="cuda", generator=gen).to(torch.bfloat16)
        weight = (torch.randn(args.vocab, args.hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        targets = torch.randint(0, args.vocab, (n,), device="cuda", generator=gen)
        targets[: n // 8] = -100  # a prompt share, as SFT data has
        for train_weight in heads:
            head = "trained" if train_weight else "frozen"
            ref_value = None
            for name in names:
                if train_weight and "float8 head" in name:
                    continue  # a trained head stays bf16
                if "triton" in name and not triton_available("cuda"):
                    print(f"| {n} | {head} | {name} | skipped: triton not installed | | | |")
                    continue
                try:
                    fn = factories[name]()
                    ms, peak, value, first_s = _measure(fn, hidden, weight, targets, train_weight, args.warmup, args.repeats)
                    if name == "reference eager":
                        ref_value = value
                    err = f"{abs(value - ref_value) / abs(ref_value):.1e}" if ref_value else "-"
                    print(f"| {n} | {head} | {name} | {ms:.2f} | {peak:,.0f} | {err} | {first_s:.1f} |")
                except torch.OutOfMemoryError:
                    print(f"| {n} | {head} | {name} | OOM | OOM | | |")
                except Exception as exc:  # a row, not the end of the run
                    message = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
                    print(f"| {n} | {head} | {name} | error: {type(exc).__name__}: {message} | | | |")
                finally:
                    fn = None
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                sys.stdout.flush()
        del hidden, weight, targets
        torch.cuda.empty_cache()
    print(f"\ntotal {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
