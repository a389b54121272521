"""The MXFP4 grouped expert kernels (hone.kernels.moe_mxfp4) on CUDA at one layer's shapes of
gpt-oss-20b (32 experts, hidden 2880, gate_up 5760 x 2880, down 2880 x 2880, top-4, per-expert
biases, its layout) and of qwen3-30b-a3b (128 experts, hidden 2048, experts of 768, top-8, no
biases), 2048 tokens, LoRA r16, routing skewed with empty experts, random MXFP4 weights (every
code, scales around 2**-8): output and every gradient against the float32 reference on the
dequantized weights (bf16: relative error in norm within 1.5x that of the same reference run in
plain bf16, plus 2e-3, and <= 3e-2; fp32: <= 1e-4, IEEE dots), and one projection's LoRA
gradients equal, bit for bit, the bf16 kernels' on the dequantized weight. Skipped without a GPU."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from moe_lora_checks import skewed_routing  # noqa: E402
from moe_mxfp4_checks import TRAINABLE, random_mxfp4, run_experts  # noqa: E402

from hone.kernels.moe_lora import moe_lora_linear, moe_triton_available, route  # noqa: E402
from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE  # noqa: E402
from hone.kernels.moe_mxfp4 import moe_mxfp4_experts, moe_mxfp4_linear  # noqa: E402
from hone.kernels.moe_mxfp4_reference import moe_mxfp4_experts_reference  # noqa: E402
from hone.kernels.mxfp4_dequant import mxfp4_dequantize  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOKENS, RANK = 2048, 16
#: (hidden, expert width, experts, top-k, empty experts, layout, biases) of one layer of each model.
SHAPES = {
    "gpt-oss-20b": (2880, 2880, 32, 4, 2, GPT_OSS, True),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 4, QWEN3_MOE, False),
}
HIDDEN, INTER, EXPERTS, TOP_K, EMPTY, _, _ = SHAPES["gpt-oss-20b"]


def _case(seed: int = 0, model: str = "gpt-oss-20b") -> dict:
    hidden, inter, experts, top_k, empty, layout, biases = SHAPES[model]
    gen = torch.Generator().manual_seed(seed)
    index, weights = skewed_routing(TOKENS, top_k, experts, empty, gen, skew=0.97)
    cuda_gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, std=1.0):
        return torch.randn(*shape, generator=cuda_gen, device="cuda") * std

    return {
        "index": index.cuda(),
        "layout": layout,
        "tensors": {
            "hidden": rnd(TOKENS, hidden),
            "routing_weights": weights.cuda(),
            "gate_up_bias": rnd(experts, 2 * inter, std=0.1) if biases else None,
            "down_bias": rnd(experts, hidden, std=0.1) if biases else None,
            "gu_A": rnd(experts, RANK, hidden, std=0.3),
            "gu_B": rnd(experts, 2 * inter, RANK, std=0.015),  # a trained adapter's update is small beside W
            "dn_A": rnd(experts, RANK, inter, std=0.3),
            "dn_B": rnd(experts, hidden, RANK, std=0.015),
        },
        "mx": {
            "gate_up": random_mxfp4(experts, 2 * inter, hidden, cuda_gen, low=118, high=122),
            "down": random_mxfp4(experts, hidden, inter, cuda_gen, low=118, high=122),
        },
        "grad_out": rnd(TOKENS, hidden),
    }


def _rel_norm(got: dict, expected: dict) -> dict:
    return {n: ((got[n] - ref).norm() / ref.norm()).item() if n in got else float("inf") for n, ref in expected.items()}


def _reference(case: dict, dtype: torch.dtype, compute_dtype: torch.dtype = torch.float32) -> dict:
    """The reference fed the same (dtype-rounded) inputs the kernels see, computing in ``compute_dtype``."""
    rounded = dict(case, tensors={n: None if t is None else t.to(dtype).float() for n, t in case["tensors"].items()})
    return run_experts(moe_mxfp4_experts_reference, rounded, TRAINABLE, compute_dtype=compute_dtype)


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_match_float32_reference_at_real_shapes(dtype, model):
    assert moe_triton_available("cuda")
    case = _case(model=model)
    expected = _reference(case, dtype)
    got = run_experts(moe_mxfp4_experts, case, TRAINABLE, dtype=dtype)
    trained = {n for n in TRAINABLE if case["tensors"].get(n) is not None}
    assert set(got) == set(expected) == trained | {"out"}
    for name, value in got.items():
        assert torch.isfinite(value).all(), name
    errors = _rel_norm(got, expected)
    if dtype == torch.float32:
        assert all(e <= 1e-4 for e in errors.values()), errors
        return
    plain_bf16 = _rel_norm(_reference(case, dtype, compute_dtype=torch.bfloat16), expected)
    too_far = {n: (e, plain_bf16[n]) for n, e in errors.items() if e > 1.5 * plain_bf16[n] + 2e-3 or e > 3e-2}
    assert not too_far, f"(kernel, plain bf16) relative errors: {too_far}"


def test_lora_grads_equal_bf16_kernels_on_dequantized_weight():
    case = _case(seed=1)
    t = {n: v.to(torch.bfloat16) for n, v in case["tensors"].items()}
    blocks, scales = case["mx"]["gate_up"]
    perm, ends = route(case["index"], EXPERTS)
    rows = perm // TOP_K
    dense = mxfp4_dequantize(blocks, scales, torch.bfloat16)  # [E, out, in]
    grad = torch.randn(rows.shape[0], 2 * INTER, device="cuda", dtype=torch.bfloat16)

    def grads(project):
        x, a, b, bias = (t[n].clone().requires_grad_(True) for n in ("hidden", "gu_A", "gu_B", "gate_up_bias"))
        y = project(x, bias, (a, b))
        return [y.detach(), *torch.autograd.grad((y.float() * grad.float()).sum(), [x, a, b, bias])]

    mx = grads(lambda x, bias, lora: moe_mxfp4_linear(x, rows, ends, (blocks, scales), bias, lora, 0.75))
    bf16 = grads(lambda x, bias, lora: moe_lora_linear(x, rows, ends, dense, False, bias, lora, 0.75))
    assert torch.equal(mx[2], bf16[2]) and torch.equal(mx[3], bf16[3])  # dA, dB never read W
    # y, dX: the same values through another kernel variant; dbias: index_add_'s atomics on CUDA
    for got, ref in ((mx[0], bf16[0]), (mx[1], bf16[1]), (mx[4], bf16[4])):
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() <= 2e-3
