"""Checks of the MXFP4 grouped expert kernels (hone.kernels.moe_mxfp4), one case per run.

Run as ``python tests/kernels/moe_mxfp4_checks.py CASE`` with ``TRITON_INTERPRET=1`` set (before
triton is imported, hence another process: tests/interpreted.py's, from tests/kernels/test_moe_mxfp4.py); prints
``RESULT {json}``. The GPU tests import :func:`random_mxfp4` and :func:`mx_case` too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from hone.kernels.moe_lora import moe_lora_linear, route
from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE
from hone.kernels.moe_mxfp4 import moe_mxfp4_experts, moe_mxfp4_linear
from hone.kernels.moe_mxfp4_reference import dequantized, moe_mxfp4_experts_reference, mxfp4_linear_reference

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_lora_checks import compare, make_case, opcheck_each  # noqa: E402


def random_mxfp4(experts: int, out: int, inputs: int, gen: torch.Generator, low: int = 122, high: int = 128, device=None):
    """(blocks, scales) of a random ``[experts, out, inputs]`` MXFP4 weight: every code (-0 and
    -6 included), scales ``2 ** (low - 127) .. 2 ** (high - 128)`` (around 0.03 to 0.5 per unit code),
    drawn on ``gen``'s device and left there unless ``device`` is given."""
    blocks = torch.randint(0, 256, (experts, out, inputs // 32, 16), dtype=torch.uint8, generator=gen, device=gen.device)
    scales = torch.randint(low, high, (experts, out, inputs // 32), dtype=torch.uint8, generator=gen, device=gen.device)
    return (blocks, scales) if device is None else (blocks.to(device), scales.to(device))


def mx_case(
    name: str, n_tokens: int, hidden: int, inter: int, experts: int, k: int, rank: int, empty: int, seed: int, device="cpu"
):
    """A parity case of tests/kernels/moe_lora_checks.py with its two expert weights replaced by
    random MXFP4 ones (``[E, out, in]``): ``case["mx"] = {"gate_up": ..., "down": ...}``."""
    layout = GPT_OSS if name == "gptoss" else QWEN3_MOE
    case = make_case(layout, n_tokens, hidden, inter, experts, k, rank, empty, seed, 1.0, name == "gptoss", device, skew=0.7)
    gen = torch.Generator().manual_seed(seed + 1)
    case["mx"] = {
        "gate_up": random_mxfp4(experts, 2 * inter, hidden, gen, device=device),
        "down": random_mxfp4(experts, hidden, inter, gen, device=device),
    }
    return case


def run_experts(fn, case: dict, trainable: set[str], dtype: torch.dtype = torch.float32, scaling: float = 0.75, **kw) -> dict:
    """Forward and backward of ``fn`` (:func:`moe_mxfp4_experts` or its reference); the output
    and the ``trainable`` tensors' gradients in float32."""
    ts = {}
    for name, t in case["tensors"].items():
        if t is None or name in ("gate_up", "down"):
            continue
        t = t.detach().to(dtype).clone()
        ts[name] = t.requires_grad_(True) if name in trainable else t
    out = fn(
        ts["hidden"],
        case["index"],
        ts["routing_weights"],
        case["mx"]["gate_up"],
        case["mx"]["down"],
        case["layout"],
        ts.get("gate_up_bias"),
        ts.get("down_bias"),
        (ts["gu_A"], ts["gu_B"]),
        (ts["dn_A"], ts["dn_B"]),
        scaling,
        **kw,
    )
    (out.float() * case["grad_out"]).sum().backward()
    result = {"out": out.detach().float()}
    result.update({name: ts[name].grad.float() for name in trainable if name in ts})
    return result


TRAINABLE = {"hidden", "routing_weights", "gu_A", "gu_B", "dn_A", "dn_B", "gate_up_bias", "down_bias"}


def check_experts(name: str) -> dict:
    """Both projections and the activation, against the dequantize-then-reference path."""
    case = mx_case(name, 24, 64, 32, 4, 2, 4, 1, seed=11)
    trainable = {n for n in TRAINABLE if case["tensors"].get(n) is not None}
    got = run_experts(moe_mxfp4_experts, case, trainable)
    expected = run_experts(moe_mxfp4_experts_reference, case, trainable)
    # gate/up pre-activations of expert 0 past the clamp limit: the gpt_oss clamp must bite
    gate_up = case["tensors"]["hidden"] @ dequantized(case["mx"]["gate_up"])[0].T
    clamped = (gate_up.abs() > case["layout"].swiglu_limit).float().mean().item()
    return {"errors": compare(got, expected), "names": sorted(got), "clamped_fraction": clamped}


def _linear_inputs(seed: int = 5) -> dict:
    """One projection, E=4, in=64, out=96, rank 4, 10 tokens top-2 over experts 0 and 2 only
    (experts 1 and 3 get no rows), rows gathered from the tokens, per-expert bias."""
    gen = torch.Generator().manual_seed(seed)
    n_tokens, k, experts = 10, 2, 4
    index = torch.stack([torch.tensor([0, 2])[torch.randperm(2, generator=gen)] for _ in range(n_tokens)])
    perm, ends = route(index, experts)
    return {
        "rows": perm // k,
        "ends": ends,
        "weight": random_mxfp4(experts, 96, 64, gen),
        "x": torch.randn(n_tokens, 64, generator=gen),
        "A": torch.randn(experts, 4, 64, generator=gen) * 0.3,
        "B": torch.randn(experts, 96, 4, generator=gen) * 0.3,
        "bias": torch.randn(experts, 96, generator=gen),
        "grad": torch.randn(n_tokens * k, 96, generator=gen),
    }


def _linear_run(fn, inp: dict) -> dict:
    x, a, b, bias = (inp[n].clone().requires_grad_(True) for n in ("x", "A", "B", "bias"))
    y = fn(x, a, b, bias)
    grads = torch.autograd.grad((y * inp["grad"]).sum(), [x, a, b, bias])
    return {"y": y.detach(), "x": grads[0], "A": grads[1], "B": grads[2], "bias": grads[3]}


def check_linear() -> dict:
    """One projection: y, dX, dA, dB, dbias against the reference; and against the bf16 path
    (:func:`moe_lora_linear`) on the dequantized float32 weight, whose dA/dB must be equal."""
    inp = _linear_inputs()
    rows, ends, weight = inp["rows"], inp["ends"], inp["weight"]
    expert_of_row = torch.searchsorted(ends, torch.arange(rows.shape[0], dtype=ends.dtype), right=True)
    got = _linear_run(lambda x, a, b, bias: moe_mxfp4_linear(x, rows, ends, weight, bias, (a, b), 0.75), inp)
    ref = _linear_run(lambda x, a, b, bias: mxfp4_linear_reference(x[rows], expert_of_row, weight, bias, (a, b), 0.75), inp)
    w = dequantized(weight)
    bf16_path = _linear_run(lambda x, a, b, bias: moe_lora_linear(x, rows, ends, w, False, bias, (a, b), 0.75), inp)
    return {
        "errors": compare(got, ref),
        "lora_grads_equal_bf16_path": {n: bool(torch.equal(got[n], bf16_path[n])) for n in ("A", "B")},
        "errors_vs_bf16_path": compare(got, bf16_path),
        "rows_per_expert": torch.diff(ends, prepend=ends.new_zeros(1)).tolist(),
    }


def check_input_grad_only() -> dict:
    """The input gradient with no LoRA and no row gather (the down projection of a frozen base)."""
    inp = _linear_inputs(seed=9)
    ends, weight = inp["ends"], inp["weight"]
    x = torch.randn(inp["rows"].shape[0], 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    expert_of_row = torch.searchsorted(ends, torch.arange(x.shape[0], dtype=ends.dtype), right=True)
    y = moe_mxfp4_linear(x, None, ends, weight)
    (dx,) = torch.autograd.grad((y * inp["grad"]).sum(), [x])
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = mxfp4_linear_reference(x_ref, expert_of_row, weight)
    (dx_ref,) = torch.autograd.grad((y_ref * inp["grad"]).sum(), [x_ref])
    return {"errors": compare({"y": y.detach(), "x": dx}, {"y": y_ref.detach(), "x": dx_ref})}


def check_opcheck() -> dict:
    """torch.library.opcheck on both ops (schema, fake tensors, autograd registration)."""
    from hone.kernels.moe_mxfp4 import _moe_mxfp4_lora_linear, mxfp4_grouped_mm

    inp = _linear_inputs()
    rows, ends, (blocks, scales) = inp["rows"], inp["ends"], inp["weight"]
    x = inp["x"]
    dy = torch.randn(rows.shape[0], 96)
    return opcheck_each(
        (
            ("grouped_mm_forward", mxfp4_grouped_mm, (x, rows, ends, blocks, scales, True, inp["bias"], None, None, 0.0)),
            ("grouped_mm_input_grad", mxfp4_grouped_mm, (dy, None, ends, blocks, scales, False, None, None, None, 0.0)),
            (
                "lora_linear",
                _moe_mxfp4_lora_linear,
                (
                    x.clone().requires_grad_(True),
                    rows,
                    ends,
                    blocks,
                    scales,
                    inp["bias"].clone().requires_grad_(True),
                    inp["A"].clone().requires_grad_(True),
                    inp["B"].clone().requires_grad_(True),
                    0.5,
                    None,
                ),
            ),
        )
    )


def check_compile() -> dict:
    """``torch.compile(fullgraph=True, backend="aot_eager")`` of the experts, forward and backward."""
    case = mx_case("gptoss", 12, 64, 32, 4, 2, 4, 1, seed=3)
    trainable = {n for n in TRAINABLE if case["tensors"].get(n) is not None}
    eager = run_experts(moe_mxfp4_experts, case, trainable)
    torch._dynamo.reset()
    compiled = run_experts(torch.compile(moe_mxfp4_experts, fullgraph=True, backend="aot_eager"), case, trainable)
    return {"errors": compare(compiled, eager)}


CHECKS = {
    "linear": check_linear,
    "input_grad_only": check_input_grad_only,
    "experts_gptoss": lambda: check_experts("gptoss"),
    "experts_qwen": lambda: check_experts("qwen"),
    "opcheck": check_opcheck,
    "compile": check_compile,
}


if __name__ == "__main__":
    print("RESULT " + json.dumps(CHECKS[sys.argv[1]]()))
