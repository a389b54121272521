"""The fused LoRA linear against PEFT's arithmetic (:func:`lora_linear_reference`): outputs and
the gradients of the input and both factors, on a float32 weight (with and without bias) and on
float8 weights of both scalings, with and without a separate (dropout) LoRA input; compiled with
``fullgraph`` (no graph break), alone and under Inductor's memory budget, copying no output;
the two ops' registration (``opcheck``);
a small bf16 check under autocast with float32 factors, as hone runs LoRA."""

import contextlib

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from hone.kernels.fp8_linear import FrozenFp8Weight, float8_operands, quantize_frozen_weight
from hone.kernels.lora_linear import lora_linear, lora_linear_reference
from hone.transforms.checkpointing import memory_budget_context

SCALING = 0.7  # not a power of two: the rank-side scaling rounds differently from PEFT's


def _operands(seed: int, n: int = 48, k: int = 32, r: int = 4):
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(3, 5, k, generator=gen),
        "weight": torch.randn(n, k, generator=gen) * 0.2,
        "bias": torch.randn(n, generator=gen),
        "lora_a": torch.randn(r, k, generator=gen) * 0.3,
        "lora_b": torch.randn(n, r, generator=gen) * 0.3,
        "grad": torch.randn(3, 5, n, generator=gen),
        "mask": (torch.rand(3, 5, k, generator=gen) > 0.25).float() / 0.75,
    }


def _run(fn, ops, base, bias, separate: bool):
    """Output and gradients of x, A, B (fresh leaves each call)."""
    x = ops["x"].clone().requires_grad_()
    a = ops["lora_a"].clone().requires_grad_()
    b = ops["lora_b"].clone().requires_grad_()
    x_lora = x * ops["mask"] if separate else None  # a dropout's output: a function of x
    y = fn(x, base, bias, a, b, SCALING, x_lora=x_lora)
    y.backward(ops["grad"])
    return y.detach(), x.grad, a.grad, b.grad


def _base(ops, kind: str):
    return ops["weight"] if kind == "float32" else quantize_frozen_weight(ops["weight"], kind)


@pytest.mark.parametrize("separate", [False, True], ids=["lora_on_x", "lora_on_dropout_x"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("kind", ["float32", "tensorwise", "rowwise"])
def test_fused_equals_peft_arithmetic_output_and_gradients(kind, with_bias, separate):
    ops = _operands(seed=1)
    base, bias = _base(ops, kind), ops["bias"] if with_bias else None
    got = _run(lora_linear, ops, base, bias, separate)
    want = _run(lora_linear_reference, ops, base, bias, separate)
    for name, g, w in zip(("out", "dx", "dA", "dB"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        assert g.abs().max() > 0.1, f"{name} is (near) zero: the check compares nothing"


def test_the_lora_term_is_there_to_compare():
    """The parity above would hold for a layer that dropped LoRA if LoRA were negligible: it is not."""
    ops = _operands(seed=2)
    full = _run(lora_linear, ops, ops["weight"], None, False)[0]
    base_only = ops["x"] @ ops["weight"].t()
    assert (full - base_only).abs().max() > 0.1


def test_no_input_gradient_when_the_input_needs_none():
    ops = _operands(seed=3)
    a = ops["lora_a"].clone().requires_grad_()
    y = lora_linear(ops["x"], ops["weight"], None, a, ops["lora_b"], SCALING)
    y.backward(ops["grad"])
    reference = lora_linear_reference(ops["x"], ops["weight"], None, a, ops["lora_b"], SCALING)
    want_a = torch.autograd.grad(reference, a, ops["grad"])[0]
    torch.testing.assert_close(a.grad, want_a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [None, 0.1], ids=["no_budget", "memory_budget_0.1"])
@pytest.mark.parametrize("kind", ["float32", "tensorwise"])
def test_compiled_fullgraph_equals_eager_and_copies_nothing(kind, budget):
    """Compiled as hone compiles a layer, alone and under Inductor's memory budget (0.1: the
    partitioner recomputes in the backward): the same numbers as eager, the base matmul and its
    LoRA sum one op in both graphs, and no copy of an output (what the in-place sum cost when the
    partitioner could keep the base's output apart from it)."""
    ops = _operands(seed=4)
    base = _base(ops, kind)
    op = "hone.mm_lora" if kind == "float32" else "hone.scaled_mm_lora"

    def layer(x, a, b):
        # the input comes from an op of the graph and the output feeds one, as in a decoder layer
        return torch.tanh(lora_linear(torch.tanh(x), base, None, a, b, SCALING)).pow(2)

    leaves = [ops[k].clone().requires_grad_() for k in ("x", "lora_a", "lora_b")]
    compiled = torch.compile(layer, fullgraph=True)

    def step():
        with memory_budget_context(budget) if budget is not None else contextlib.nullcontext():
            out = compiled(*leaves)
            out.backward(ops["grad"])
        return out

    out, code = run_and_get_code(step)
    eager_leaves = [ops[k].clone().requires_grad_() for k in ("x", "lora_a", "lora_b")]
    eager = layer(*eager_leaves)
    eager.backward(ops["grad"])
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(leaves, eager_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)
    assert len(code) == 2, "expected one forward and one backward graph"
    forward, backward = code
    assert op in forward and op in backward and "clone" not in forward + backward
    if budget is not None:  # recomputed whole in the backward: the op runs twice there
        assert backward.count(f"torch.ops.{op}.default(") == 2


@pytest.mark.parametrize("kind", ["float32", "tensorwise", "rowwise"])
def test_op_registration(kind):
    gen = torch.Generator().manual_seed(6)
    a, w = torch.randn(8, 32, generator=gen), torch.randn(16, 32, generator=gen)
    lora_in, lora_out = torch.randn(8, 3, generator=gen), torch.randn(3, 16, generator=gen)
    if kind == "float32":
        torch.library.opcheck(torch.ops.hone.mm_lora.default, (a, w.t(), None, lora_in, lora_out))
        torch.library.opcheck(torch.ops.hone.mm_lora.default, (a, w.t(), torch.randn(16, generator=gen), lora_in, lora_out))
        return
    q = quantize_frozen_weight(w, kind)
    a_q, scale_a, scale_b = float8_operands(a, q.w_scale)
    args = (a_q, scale_a, q.w_q.t(), scale_b, lora_in, lora_out, torch.float32, True)
    # test_schema perturbs the inputs arithmetically, which float8 tensors do not support on the CPU
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.hone.scaled_mm_lora.default, args, test_utils=checks)


def test_bf16_base_under_autocast_with_float32_factors():
    """hone's LoRA precision: bf16 base and activations, float32 factors, autocast on; the output
    is bf16 and the factors' gradients float32, within bf16's rounding of PEFT's arithmetic."""
    ops = _operands(seed=7)
    x = ops["x"].to(torch.bfloat16)
    weight = ops["weight"].to(torch.bfloat16)
    results = []
    for fn in (lora_linear, lora_linear_reference):
        a, b = ops["lora_a"].clone().requires_grad_(), ops["lora_b"].clone().requires_grad_()
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xi, weight, None, a, b, SCALING)
        y.float().backward(ops["grad"])
        results.append((y, xi.grad, a.grad, b.grad))
    (y, dx, da, db), (ry, rdx, rda, rdb) = results
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and da.dtype == db.dtype == torch.float32
    for name, got, want in (("out", y, ry), ("dx", dx, rdx), ("dA", da, rda), ("dB", db, rdb)):
        # relative to the tensor's norm: an element of a bf16 sum near zero can differ by more
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 1e-2, f"{name}: {rel:.2e} relative to PEFT's arithmetic"


def test_float8_weight_dataclass_is_what_the_base_argument_takes():
    ops = _operands(seed=8)
    q = quantize_frozen_weight(ops["weight"], "tensorwise")
    assert isinstance(q, FrozenFp8Weight)
    y = lora_linear(ops["x"], q, None, ops["lora_a"], ops["lora_b"], SCALING)
    assert y.shape == (3, 5, 48)
