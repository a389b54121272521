"""Parity checks of the grouped MoE kernels against the float32 reference, one case per run.

Run as ``python tests/kernels/moe_lora_checks.py CASE`` with ``TRITON_INTERPRET=1`` in the
environment (it must be set before triton is imported, hence another process:
tests/kernels/test_moe_lora.py runs each case in the interpreter process of
tests/interpreted.py); prints ``RESULT {json}`` with the measured relative errors, which the
test asserts on. The GPU tests import :func:`make_case`, :func:`compare` and
:func:`check_readers` too.
"""

from __future__ import annotations

import json
import sys
import zlib

import torch

from hone.kernels.moe_lora import moe_experts
from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE, ExpertsLayout, moe_experts_reference

NAMES = ("hidden", "routing_weights", "gate_up", "down", "gate_up_bias", "down_bias", "gu_A", "gu_B", "dn_A", "dn_B")


def skewed_routing(
    n_tokens: int, k: int, num_experts: int, empty: int, gen: torch.Generator, skew: float = 0.7
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k_index, top_k_weights): distinct experts per token drawn with probabilities that
    fall geometrically by ``skew`` (expert 0 gets many rows, the tail few), the last ``empty``
    experts never chosen. Weights are a softmax, as a router's top-k renormalised scores are."""
    live = num_experts - empty
    probs = skew ** torch.arange(live, dtype=torch.float64)
    index = torch.stack([torch.multinomial(probs, k, replacement=False, generator=gen) for _ in range(n_tokens)])
    weights = torch.randn(n_tokens, k, generator=gen).softmax(-1)
    return index, weights


def make_case(
    layout: ExpertsLayout,
    n_tokens: int,
    hidden: int,
    inter: int,
    num_experts: int,
    k: int,
    rank: int,
    empty: int,
    seed: int,
    weight_std: float,
    bias: bool,
    device: str = "cpu",
    skew: float = 0.7,
) -> dict:
    """Fresh random inputs for one parity case (float32 on ``device``)."""
    gen = torch.Generator().manual_seed(seed)
    index, weights = skewed_routing(n_tokens, k, num_experts, empty, gen, skew)

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(device)

    if layout.transposed:
        gate_up, down = rnd(num_experts, hidden, 2 * inter, std=weight_std), rnd(num_experts, inter, hidden, std=weight_std)
    else:
        gate_up, down = rnd(num_experts, 2 * inter, hidden, std=weight_std), rnd(num_experts, hidden, inter, std=weight_std)
    return {
        "index": index.to(device),
        "tensors": {
            "hidden": rnd(n_tokens, hidden),
            "routing_weights": weights.to(device),
            "gate_up": gate_up,
            "down": down,
            "gate_up_bias": rnd(num_experts, 2 * inter) if bias else None,
            "down_bias": rnd(num_experts, hidden) if bias else None,
            "gu_A": rnd(num_experts, rank, hidden, std=0.3) if rank else None,
            "gu_B": rnd(num_experts, 2 * inter, rank, std=0.3) if rank else None,
            "dn_A": rnd(num_experts, rank, inter, std=0.3) if rank else None,
            "dn_B": rnd(num_experts, hidden, rank, std=0.3) if rank else None,
        },
        "layout": layout,
        "grad_out": rnd(n_tokens, hidden),
    }


def run(fn, case: dict, trainable: set[str], dtype: torch.dtype = torch.float32, scaling: float = 0.75) -> dict:
    """Forward and backward of ``fn`` (the reference or the kernel path); returns the output and
    the gradients of the ``trainable`` tensors (the others are frozen), in float32."""
    ts = {}
    for name, t in case["tensors"].items():
        if t is None:
            ts[name] = None
            continue
        t = t.detach().to(dtype).clone()  # a fresh leaf per run: gradients never shared
        ts[name] = t.requires_grad_(True) if name in trainable else t
    gu_lora = (ts["gu_A"], ts["gu_B"]) if ts["gu_A"] is not None else None
    dn_lora = (ts["dn_A"], ts["dn_B"]) if ts["dn_A"] is not None else None
    out = fn(
        ts["hidden"],
        case["index"],
        ts["routing_weights"],
        ts["gate_up"],
        ts["down"],
        case["layout"],
        ts["gate_up_bias"],
        ts["down_bias"],
        gu_lora,
        dn_lora,
        scaling,
    )
    (out.float() * case["grad_out"]).sum().backward()
    result = {"out": out.detach().float()}
    for name in trainable:
        if ts.get(name) is not None:
            result[name] = ts[name].grad.float() if ts[name].grad is not None else None
    return result


def compare(got: dict, expected: dict) -> dict:
    """Relative max error per tensor (``max|a-b| / max|b|``), or a message where a gradient is missing."""
    errors = {}
    for name, ref in expected.items():
        value = got.get(name)
        if value is None or ref is None:
            errors[name] = f"missing: got {value is not None}, reference {ref is not None}"
            continue
        errors[name] = ((value - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return errors


LORA = {"hidden", "routing_weights", "gu_A", "gu_B", "dn_A", "dn_B"}
FULL = {"hidden", "routing_weights", "gate_up", "down", "gate_up_bias", "down_bias"}

CASES = {
    # name: (layout, tokens, hidden, inter, experts, k, rank, empty experts, weight std, bias, trainable)
    "qwen_k1_lora": (QWEN3_MOE, 40, 24, 20, 4, 1, 4, 1, 0.3, False, LORA),
    "qwen_k2_lora": (QWEN3_MOE, 24, 24, 20, 6, 2, 8, 2, 0.3, False, LORA),
    "qwen_k8_lora": (QWEN3_MOE, 6, 16, 12, 10, 8, 4, 1, 0.3, False, LORA),
    "qwen_k2_full": (QWEN3_MOE, 24, 24, 20, 6, 2, 0, 2, 0.3, False, FULL),
    "qwen_k2_lora_and_weights": (QWEN3_MOE, 20, 24, 20, 5, 2, 4, 1, 0.3, False, LORA | FULL),
    # gpt_oss: weight std 1 drives some gate/up values past the clamp limit (7).
    "gptoss_k2_lora": (GPT_OSS, 24, 24, 20, 6, 2, 4, 2, 1.0, True, LORA),
    "gptoss_k8_lora": (GPT_OSS, 6, 16, 12, 10, 8, 4, 1, 1.0, True, LORA),
    "gptoss_k2_full": (GPT_OSS, 20, 24, 20, 5, 2, 4, 1, 1.0, True, LORA | FULL),
}


def check(name: str) -> dict:
    layout, tokens, hidden, inter, experts, k, rank, empty, std, bias, trainable = CASES[name]
    case = make_case(
        layout, tokens, hidden, inter, experts, k, rank, empty, seed=zlib.crc32(name.encode()) % 1000, weight_std=std, bias=bias
    )
    trainable = {n for n in trainable if case["tensors"].get(n) is not None}
    expected = run(moe_experts_reference, case, trainable)
    got = run(moe_experts, case, trainable)
    result = {"errors": compare(got, expected)}
    if layout.activation == "clamped_swiglu":
        # The clamp must bite somewhere, or the case does not test it.
        from hone.kernels.moe_lora_reference import as_in_out

        x = case["tensors"]["hidden"]
        w = as_in_out(case["tensors"]["gate_up"], True)
        result["clamped_fraction"] = ((x @ w[0]).abs() > layout.swiglu_limit).float().mean().item()
    return result


def check_compile() -> dict:
    """``torch.compile(fullgraph=True, backend="aot_eager")`` of the kernel path, forward and
    backward: a graph break raises; the compiled result must equal eager."""
    case = make_case(QWEN3_MOE, 12, 16, 12, 4, 2, 4, 1, seed=7, weight_std=0.3, bias=False)
    trainable = {n for n in LORA if case["tensors"].get(n) is not None}
    eager = run(moe_experts, case, trainable)
    torch._dynamo.reset()
    compiled = run(torch.compile(moe_experts, fullgraph=True, backend="aot_eager"), case, trainable)
    return {"errors": compare(compiled, eager)}


def opcheck_each(cases) -> dict:
    """``torch.library.opcheck`` on each ``(name, op, args)``: "ok", or the error for the test to print."""
    results = {}
    for name, op, args in cases:
        try:
            torch.library.opcheck(op, args)
            results[name] = "ok"
        except Exception as exc:  # reported to the test, which prints it
            results[name] = repr(exc)[:2000]
    return results


def check_opcheck() -> dict:
    """torch.library.opcheck on the three ops (schema, fake tensors, autograd registration)."""
    from hone.kernels.moe_lora import _moe_lora_linear, grouped_mm, grouped_wgrad, route

    gen = torch.Generator().manual_seed(3)
    index, _ = skewed_routing(8, 2, 4, 1, gen)
    perm, ends = route(index, 4)
    rows = perm // 2
    x = torch.randn(8, 16, generator=gen)
    w = torch.randn(4, 20, 16, generator=gen)
    a = torch.randn(4, 4, 16, generator=gen)
    b = torch.randn(4, 20, 4, generator=gen)
    dy = torch.randn(16, 20, generator=gen)
    return opcheck_each(
        (
            ("grouped_mm", grouped_mm, (x, rows, ends, w.transpose(1, 2), None, None, None, 0.0)),
            ("grouped_wgrad", grouped_wgrad, (x, dy, rows, True, False, ends, 0.5, torch.float32)),
            (
                "moe_lora_linear",
                _moe_lora_linear,
                (
                    x.clone().requires_grad_(True),
                    rows,
                    ends,
                    w,
                    False,
                    None,
                    a.requires_grad_(True),
                    b.requires_grad_(True),
                    0.5,
                    None,
                ),
            ),
            (
                "moe_lora_linear_readers",
                _moe_lora_linear,
                (x.clone().requires_grad_(True), rows, ends, w, False, None, a, b, 0.5, readers_of(perm, 2, 8)),
            ),
        )
    )


def readers_of(perm: torch.Tensor, k: int, n_x: int) -> torch.Tensor:
    """``[n_x, k]``: for token ``t``, the sorted rows of its ``k`` pairs (``perm[i]`` = pair at row ``i``)."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0])
    return inverse.view(n_x, k)


def check_readers(
    n_x: int = 10,
    k: int = 3,
    hidden: int = 16,
    out_dim: int = 20,
    experts: int = 4,
    rank: int = 4,
    spare: int = 7,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict:
    """The gathered input gradient (``readers``) against the atomic scatter (none), as expert
    parallelism calls it: the sorted pairs' rows past the real ones (capacity) read a padding
    row appended to ``x``, the kernels leave their rows unwritten, and the padding row's
    gradient is dropped. Output and every gradient must agree (relative errors returned)."""
    from hone.kernels.moe_lora import moe_lora_linear, route

    gen = torch.Generator().manual_seed(11)
    index, _ = skewed_routing(n_x, k, experts, 1, gen)
    perm, ends = route(index, experts)
    n_pairs = n_x * k + spare  # capacity past the real pairs: rows name the padding row n_x
    rows = torch.cat([perm // k, torch.full((spare,), n_x)])
    readers = torch.cat([readers_of(perm, k, n_x), torch.full((1, k), n_pairs)])
    x = torch.cat([torch.randn(n_x, hidden, generator=gen), torch.zeros(1, hidden)])
    w = torch.randn(experts, out_dim, hidden, generator=gen) * 0.3
    a = torch.randn(experts, rank, hidden, generator=gen) * 0.3
    b = torch.randn(experts, out_dim, rank, generator=gen) * 0.3
    grad = torch.randn(n_x * k, out_dim, generator=gen)  # the capacity rows' outputs are never read
    rows, ends, readers, grad = (t.to(device) for t in (rows, ends.to(device), readers, grad))
    x, w, a, b = (t.to(device, dtype) for t in (x, w, a, b))

    def run_with(readers_arg):
        leaves = [t.clone().requires_grad_(True) for t in (x, a, b)]
        y = moe_lora_linear(leaves[0], rows, ends, w, False, None, (leaves[1], leaves[2]), 0.5, readers_arg)
        (y[: n_x * k].float() * grad).sum().backward()
        grads = {"x": leaves[0].grad[:n_x], "A": leaves[1].grad, "B": leaves[2].grad}
        return {"y": y[: n_x * k].detach().float(), **{name: g.float() for name, g in grads.items()}}

    got, expected = run_with(readers), run_with(None)
    return {"errors": compare(got, expected)}


def check_recompute(budget: float = 0.35) -> dict:
    """How many grouped projections Inductor's memory-budget partitioner recomputes in the
    backward of a small MoE block (a matmul standing for attention, the gate/up projection, a
    chain of pointwise ops, the down projection), under hone's budget context (the ops' FLOP
    formulas weighed by the knapsack) and under the bare budget (the ops taken for free)."""
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from hone.kernels.moe_lora import moe_lora_linear, route
    from hone.transforms.checkpointing import memory_budget_context

    gen = torch.Generator().manual_seed(11)
    tokens, hidden, inter, experts, k, rank = 64, 32, 48, 4, 2, 4
    w_gu, w_dn = (
        torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1,
        torch.randn(experts, hidden, inter, generator=gen) * 0.1,
    )
    factors = [
        torch.randn(*shape, generator=gen).requires_grad_() for shape in ((experts, rank, hidden), (experts, 2 * inter, rank))
    ]
    factors += [
        torch.randn(*shape, generator=gen).requires_grad_() for shape in ((experts, rank, inter), (experts, hidden, rank))
    ]
    mix = torch.randn(hidden, hidden, generator=gen).requires_grad_()
    index = torch.randint(0, experts, (tokens, k), generator=gen)

    def block(x):
        x = x + torch.tanh(x @ mix)
        perm, ends = route(index, experts)
        gate, up = moe_lora_linear(x, perm // k, ends, w_gu, False, None, (factors[0], factors[1]), 2.0).chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        h = torch.tanh(h) * torch.sigmoid(h) + h.exp().clamp(max=5)
        return moe_lora_linear(h, None, ends, w_dn, False, None, (factors[2], factors[3]), 2.0).sum() + x.sum()

    def recomputed(context) -> int:
        graphs = {}

        def keep(name):
            def compiler(gm, example_inputs):
                graphs[name] = gm
                return gm

            return compiler

        backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=min_cut_rematerialization_partition)
        torch._dynamo.reset()
        with context:
            torch.compile(block, backend=backend, fullgraph=True)(
                torch.randn(tokens, hidden, generator=gen).requires_grad_()
            ).backward()
        return sum(n.target is torch.ops.hone.moe_lora_linear.default for n in graphs["bw"].graph.nodes)

    return {
        "hone": recomputed(memory_budget_context(budget)),
        "bare": recomputed(functorch_config.patch(activation_memory_budget=budget)),
        "unbudgeted": recomputed(functorch_config.patch(activation_memory_budget=1.0)),
    }


def check_autotune() -> dict:
    """How many autotune configs each kernel carries here (one under the interpreter)."""
    from hone.kernels.moe_lora_triton import grouped_mm_kernel, grouped_wgrad_kernel

    return {"grouped_mm": len(grouped_mm_kernel.configs), "grouped_wgrad": len(grouped_wgrad_kernel.configs)}


if __name__ == "__main__":
    which = sys.argv[1]
    if which == "autotune":
        out = check_autotune()
    elif which == "compile":
        out = check_compile()
    elif which == "opcheck":
        out = check_opcheck()
    elif which == "readers":
        out = check_readers()
    elif which == "recompute":
        out = check_recompute()
    else:
        out = check(which)
    print("RESULT " + json.dumps(out))
