"""Micro-benchmark: one MoE experts layer with LoRA on the experts, hone's grouped kernels vs
transformers' ``grouped_mm`` experts under PEFT ``target_parameters`` (the reference path).

Not a test. Times forward+backward (CUDA events, warm-up, median of ``--repeats``) and the peak
memory above the inputs of each variant, at one qwen3-30b-a3b MoE layer (hidden 2048, expert
intermediate 768, 128 experts, top-8; bf16) or gpt-oss-20b's (``--model gpt-oss-20b``), with
LoRA r16 on gate_up and down of every expert (LoRA factors float32, as hone keeps them), and
with the expert weights trained (full fine-tune, no LoRA). Routing is a softmax top-k of a
random router, as a real router's is. ``out rel err`` is the output's relative difference (in
norm) from the reference row of the same group. Each variant runs in its own try/except.

    PYTHONPATH=$PWD python scripts/bench_moe_lora.py                       # seq 2048 and 8192
    PYTHONPATH=$PWD python scripts/bench_moe_lora.py --tokens 4096 --model gpt-oss-20b
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from hone.kernels.moe_lora import moe_experts, moe_triton_available
from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE

MODELS = {
    # name: (hidden, intermediate, experts, top-k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "gpt-oss-20b": (2880, 2880, 32, 4),
}


class _Holder(nn.Module):
    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts

    def forward(self, hidden, index, weights):
        return self.experts(hidden, index, weights)


def _experts_module(model: str, implementation: str) -> nn.Module:
    hidden, inter, experts, k = MODELS[model]
    if model == "qwen3-30b-a3b":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=k)
        cls = Qwen3MoeExperts
    else:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        config = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=k)
        cls = GptOssExperts
    config._experts_implementation = implementation
    torch.manual_seed(0)  # every row of a group starts from the same weights
    with torch.device("cuda"):
        module = cls(config)
    for p in module.parameters():
        nn.init.normal_(p, std=0.02)
    return module.to(torch.bfloat16)


def _lora_factors(peft_model: nn.Module, num_experts: int) -> tuple[dict, float]:
    """PEFT's per-expert view of its ParamWrappers' factors (A [E, r, in], B [E, out, r])."""
    factors, scaling = {}, 1.0
    for module in peft_model.modules():
        if hasattr(module, "parameter_name") and "default" in getattr(module, "lora_A", {}):
            a = module.lora_A["default"].weight
            b = module.lora_B["default"].weight
            factors[module.parameter_name] = (
                a.view(num_experts, -1, a.shape[-1]),
                b.view(b.shape[0], -1, num_experts).permute(2, 0, 1),
            )
            scaling = module.scaling["default"]
    return factors, scaling


def _measure(step, warmup: int, repeats: int):
    """(median ms, peak MiB above what was allocated before, output, first-call seconds)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20, out, first_s


def _rows(model: str, tokens: int, rank: int):
    """(group, variant name, step factory) for every row; factories build lazily."""
    hidden, inter, experts, k = MODELS[model]
    layout = QWEN3_MOE if model == "qwen3-30b-a3b" else GPT_OSS
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    router = torch.randn(hidden, experts, device="cuda", generator=gen) / hidden**0.5
    top_w, top_i = torch.topk((x.float() @ router).softmax(-1), k, dim=-1)
    top_w = (top_w / top_w.sum(-1, keepdim=True)).to(torch.bfloat16)
    grad = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)

    def biases(module):
        if layout.transposed:
            return {"gate_up_bias": module.gate_up_proj_bias, "down_bias": module.down_proj_bias}
        return {}

    def lora_reference(implementation):
        def build():
            module = _experts_module(model, implementation)
            module.requires_grad_(False)
            config = LoraConfig(r=rank, lora_alpha=2 * rank, target_parameters=["experts.gate_up_proj", "experts.down_proj"])
            peft_model = get_peft_model(_Holder(module), config, autocast_adapter_dtype=True)
            for p in peft_model.parameters():
                if p.requires_grad:
                    nn.init.normal_(p, std=0.02)
            h = x.clone().requires_grad_(True)

            def step():
                out = peft_model(h, top_i, top_w)
                out.backward(grad)
                return out

            return step, (module, peft_model)

        return build

    def lora_hone(compiled: bool):
        def build():
            step_ref, (module, peft_model) = lora_reference("grouped_mm")()
            factors, scaling = _lora_factors(peft_model, experts)
            fn = moe_experts
            if compiled:
                torch._dynamo.reset()
                fn = torch.compile(moe_experts, fullgraph=True)
            h = x.clone().requires_grad_(True)
            extra = biases(module)

            def step():
                out = fn(
                    h,
                    top_i,
                    top_w,
                    module.gate_up_proj,
                    module.down_proj,
                    layout,
                    extra.get("gate_up_bias"),
                    extra.get("down_bias"),
                    factors["gate_up_proj"],
                    factors["down_proj"],
                    scaling,
                )
                out.backward(grad)
                return out

            return step, (module, peft_model)

        return build

    def full(hone: bool, compiled: bool = False):
        def build():
            module = _experts_module(model, "grouped_mm")
            h = x.clone().requires_grad_(True)
            fn = moe_experts
            if compiled:
                torch._dynamo.reset()
                fn = torch.compile(moe_experts, fullgraph=True)
            extra = biases(module)

            def step():
                for p in module.parameters():
                    p.grad = None
                if hone:
                    out = fn(
                        h,
                        top_i,
                        top_w,
                        module.gate_up_proj,
                        module.down_proj,
                        layout,
                        extra.get("gate_up_bias"),
                        extra.get("down_bias"),
                    )
                else:
                    out = module(h, top_i, top_w)
                out.backward(grad)
                return out

            return step, (module,)

        return build

    yield "lora", "reference: transformers grouped_mm + PEFT target_parameters", lora_reference("grouped_mm")
    yield "lora", "hone grouped kernels, eager", lora_hone(False)
    yield "lora", "hone grouped kernels, torch.compile fullgraph", lora_hone(True)
    yield "full", "reference: transformers grouped_mm, experts trained", full(False)
    yield "full", "hone grouped kernels, experts trained", full(True)
    yield "full", "hone grouped kernels, experts trained, torch.compile", full(True, compiled=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not moe_triton_available("cuda"):
        print("needs a CUDA GPU and triton", file=sys.stderr)
        return 2
    import triton

    hidden, inter, experts, k = MODELS[args.model]
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
        f"{args.model} experts layer: H={hidden}, I={inter}, E={experts}, top-{k}, bf16, LoRA r{args.rank}; "
        f"median of {args.repeats} after {args.warmup} warm-up\n"
    )
    print("| tokens | group | variant | fwd+bwd ms | peak MiB above inputs | out rel err | first call s |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: |")
    began = time.perf_counter()
    for tokens in args.tokens:
        reference_out = {}
        for group, name, build in _rows(args.model, tokens, args.rank):
            _keep = None
            try:
                step, _keep = build()
                ms, peak, out, first_s = _measure(step, args.warmup, args.repeats)
                out = out.detach().float()
                ref = reference_out.setdefault(group, out)
                err = "-" if ref is out else f"{((out - ref).norm() / ref.norm()).item():.1e}"
                print(f"| {tokens} | {group} | {name} | {ms:.2f} | {peak:,.0f} | {err} | {first_s:.1f} |")
            except torch.OutOfMemoryError:
                print(f"| {tokens} | {group} | {name} | OOM | OOM | | |")
            except Exception as exc:  # a row, not the end of the run
                message = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
                print(f"| {tokens} | {group} | {name} | error: {type(exc).__name__}: {message} | | | |")
            finally:
                step = _keep = None
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            sys.stdout.flush()
    print(f"\ntotal {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
