"""Check the MoE kernels' default tiles against autotuning at the bench shapes (GPU).

    PYTHONPATH=$PWD python scripts/moe_tiles.py [--model qwen3-30b-a3b gpt-oss-20b] [--tokens 2048]

By default hone's grouped kernels launch with one tile chosen from the problem's shape
(:func:`hone.kernels.moe_lora_triton.heuristic_tile`: no autotuning, one compile per kernel
variant); ``HONE_MOE_AUTOTUNE=1`` autotunes over the configs that fit. For one MoE layer's
experts (bf16 weights, LoRA r16 on gate_up and down, routing a softmax top-k of a random
router, as the benchmark's random-init model routes), this times forward + backward with the
default tiles, then autotunes every kernel and times again, and prints per kernel problem the
tile autotuning picked, the default tile, and both timings (from the autotuner's own
benchmark, where Triton's autotuning listener exists). Not a test; the first part is also what
the first training step pays for these kernels (compile only), the second what autotuning adds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

MODELS = {
    # name: (hidden, intermediate, experts, top-k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "gpt-oss-20b": (2880, 2880, 32, 4),
}


def _case(model: str, tokens: int, rank: int = 16):
    from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE

    hidden, inter, experts, k = MODELS[model]
    layout = QWEN3_MOE if model == "qwen3-30b-a3b" else GPT_OSS
    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, std=0.02, dtype=bf16, grad=False):
        return (torch.randn(*shape, generator=gen, device=dev) * std).to(dtype).requires_grad_(grad)

    x = rnd(tokens, hidden, std=1.0, grad=True)
    router = torch.randn(hidden, experts, generator=gen, device=dev) * hidden**-0.5
    probs = (x.detach().float() @ router).softmax(-1)
    weights, index = probs.topk(k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(bf16).requires_grad_(True)
    if layout.transposed:
        gate_up, down = rnd(experts, hidden, 2 * inter), rnd(experts, inter, hidden)
    else:
        gate_up, down = rnd(experts, 2 * inter, hidden), rnd(experts, hidden, inter)
    bias = layout.transposed  # gpt_oss has expert biases
    gu_bias = rnd(experts, 2 * inter) if bias else None
    dn_bias = rnd(experts, hidden) if bias else None
    f32 = torch.float32
    gu_lora = (rnd(experts, rank, hidden, dtype=f32, grad=True), rnd(experts, 2 * inter, rank, dtype=f32, grad=True))
    dn_lora = (rnd(experts, rank, inter, dtype=f32, grad=True), rnd(experts, hidden, rank, dtype=f32, grad=True))
    return (x, index, weights, gate_up, down, layout, gu_bias, dn_bias, gu_lora, dn_lora, 2.0)


def _step(args) -> None:
    from hone.kernels.moe_lora import moe_experts

    out = moe_experts(*args)
    out.float().square().mean().backward()


def _timed(args, repeats: int) -> tuple[float, float]:
    """(seconds of the first call: compiles and any autotuning, median ms of the next ones)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    _step(args)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        _step(args)
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return first, statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    os.environ.pop("HONE_MOE_AUTOTUNE", None)

    from triton import knobs

    from hone.kernels import moe_lora
    from hone.kernels import moe_lora_triton as mt

    picks: list[dict] = []
    tuning = getattr(knobs, "autotuning", None)
    if tuning is not None and hasattr(tuning, "listener"):
        tuning.listener = lambda **kw: picks.append(kw)
    for model in args.model:
        case = _case(model, args.tokens)
        for kernel in (mt.grouped_mm_kernel, mt.grouped_wgrad_kernel):
            kernel.cache.clear()  # hone's own autotuners: start each model fresh
        first, ms = _timed(case, args.repeats)
        print(f"\n## {model}, {args.tokens} tokens, LoRA r16 on the experts, fwd+bwd")
        print(f"default tiles: first call {first:.2f} s, {ms:.3f} ms")
        os.environ["HONE_MOE_AUTOTUNE"] = "1"
        picks.clear()
        moe_lora._precompiled.clear()  # compile the timed configs ahead too, as a fresh run would
        for kernel in (mt.grouped_mm_kernel, mt.grouped_wgrad_kernel):
            kernel.cache.clear()
        first_tuned, ms_tuned = _timed(case, args.repeats)
        os.environ.pop("HONE_MOE_AUTOTUNE")
        print(
            f"autotuned:     first call {first_tuned:.2f} s, {ms_tuned:.3f} ms  "
            f"({100 * (ms - ms_tuned) / ms_tuned:+.1f}% for the default tiles)"
        )
        print("\n| kernel | key | autotuned tile (ms) | default tile (ms) | configs timed | tuning s |")
        print("|---|---|---|---|---|---|")
        for pick in picks:
            fn, key, best, timings = pick["fn"], pick["key"], pick["best_config"], pick["configs_timings"] or {}
            name = fn.__name__
            if name == "grouped_mm_kernel":
                n, rows, elem = key[0], key[2], 2
                default = mt.heuristic_tile("mm", None, n, rows, elem)
            else:
                m, n, rows = key[0], key[1], key[2]
                default = mt.heuristic_tile("wgrad", m, n, rows, 2)
            default_cfg = mt._config(default)

            def ms_of(cfg):
                t = timings.get(cfg)
                return f"{t[0]:.3f}" if t else "not timed"

            def tile(cfg):
                kw = cfg.kwargs
                return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} w{cfg.num_warps} s{cfg.num_stages}"

            same = " (same)" if best is default_cfg else ""
            print(
                f"| {name} | {key[:4]} | {tile(best)} ({ms_of(best)}){same} | {tile(default_cfg)} ({ms_of(default_cfg)}) | "
                f"{len(timings)} | {pick['duration'] or 0:.2f} |"
            )
        if not picks:
            print("(this triton has no autotuning listener: set TRITON_PRINT_AUTOTUNING=1 to see the picks)")


if __name__ == "__main__":
    main()
