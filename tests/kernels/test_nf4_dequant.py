"""NF4 dequantization: hone's op equals torchao's own dequantization bit for bit.

The plain-PyTorch path runs here on the CPU; the Triton kernel runs under Triton's interpreter
in a subprocess (``TRITON_INTERPRET=1`` must be set before triton is imported), skipped where
triton is not installed. tests/gpu/test_qlora_gpu.py checks the kernel at real shapes."""

import importlib.util

import pytest
import torch
from interpreted import run_interpreted

pytest.importorskip("torchao", reason="NF4 needs the optional 'quant' extra (torchao)")

from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4  # noqa: E402

from hone.kernels.nf4_dequant import nf4_dequantize, nf4_dequantize_reference, nf4_linear  # noqa: E402
from hone.models.nf4 import nf4_components  # noqa: E402

SHAPES = [(256, 128), (128, 384), (64, 512)]


def _quantized(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(shape, generator=gen) * 0.05 + 0.01).to(dtype)
    return to_nf4(weight, 64, 256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_equals_torchao_bit_for_bit(shape, dtype):
    nf4 = _quantized(shape, dtype, seed=shape[0] + shape[1])
    expected = nf4.get_original_weight()
    got = nf4_dequantize_reference(*nf4_components(nf4), 64, 256, *shape)
    assert got.dtype == dtype and got.shape == shape
    assert torch.equal(got, expected)
    assert not torch.equal(got, torch.zeros_like(got))


def test_op_matches_reference_and_traces_without_graph_break():
    nf4 = _quantized((128, 256), torch.float32, seed=3)
    args = (*nf4_components(nf4), 64, 256, 128, 256)
    torch.library.opcheck(torch.ops.hone.nf4_dequantize.default, args)
    eager = nf4_dequantize(*args)
    assert torch.equal(eager, nf4.get_original_weight())

    def fn(packed, scalers, factors, mean, x):
        return x @ nf4_dequantize(packed, scalers, factors, mean, 64, 256, 128, 256).t()

    x = torch.randn(4, 256)
    explained = torch._dynamo.explain(fn)(*nf4_components(nf4), x)
    assert explained.graph_break_count == 0
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*nf4_components(nf4), x), x @ eager.t(), rtol=0, atol=0)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_nf4_linear_op_forward_and_input_grad_and_its_graph_holds_no_weight(dtype, tol):
    nf4 = _quantized((128, 256), dtype, seed=5)
    parts = nf4_components(nf4)
    weight = nf4.get_original_weight()
    x = torch.randn(2, 3, 256, requires_grad=True)  # float32 input, as under autocast
    torch.library.opcheck(torch.ops.hone.nf4_linear.default, (x, *parts, 64, 256, 128, 256))
    out = nf4_linear(x, *parts, 64, 256, 128, 256)
    assert out.dtype == dtype
    grad = torch.randn_like(out)
    out.backward(grad)
    x_ref = x.detach().clone().requires_grad_(True)
    out_ref = x_ref.to(dtype) @ weight.t()
    out_ref.backward(grad)
    torch.testing.assert_close(out, out_ref, rtol=tol, atol=tol)
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=tol, atol=tol)

    # traced forward+backward: one op each way, no dequantized weight in between to save
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm

    fn = aot_function(
        lambda x, *p: nf4_linear(x, *p, 64, 256, 128, 256),
        fw_compiler=keep,
        bw_compiler=keep,
        partition_fn=min_cut_rematerialization_partition,
    )
    fn(torch.randn(4, 256, requires_grad=True), *parts).sum().backward()
    forward, backward = graphs
    outputs = [n for n in forward.graph.nodes if n.op == "output"][0].args[0]
    saved = [o for o in outputs[1:] if o is not None]
    assert saved and all(o.op == "placeholder" for o in saved), saved  # only the 4-bit inputs are kept
    assert not any("nf4_dequantize" in str(n.target) for g in graphs for n in g.graph.nodes)


_CHECKS = r"""
import json
import torch
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
from hone.kernels.nf4_dequant import nf4_code
from hone.kernels.nf4_dequant_triton import nf4_dequantize_triton
from hone.models.nf4 import nf4_components

out = {}
gen = torch.Generator().manual_seed(0)
for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
    # 40 programs of 1024 bytes; 5 groups of 256 scales (a factor each)
    weight = (torch.randn(80, 1024, generator=gen) * 0.05).to(dtype)
    nf4 = to_nf4(weight, 64, 256)
    packed, scalers, factors, mean = nf4_components(nf4)
    flat = nf4_dequantize_triton(packed, scalers, factors, mean, nf4_code(dtype, "cpu"), 64, 256)
    expected = nf4.get_original_weight().reshape(-1)
    out[name] = {"mismatches": int((flat != expected).sum()), "dtype": str(flat.dtype), "numel": flat.numel()}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (CPU-only torch); the GPU tests cover the kernel")
    return run_interpreted(["-c", _CHECKS])


@pytest.mark.parametrize("name,dtype", [("fp32", "torch.float32"), ("bf16", "torch.bfloat16"), ("fp16", "torch.float16")])
def test_triton_kernel_equals_torchao_bit_for_bit(interpreted, name, dtype):
    result = interpreted[name]
    assert result["dtype"] == dtype and result["numel"] == 5 * 16384
    assert result["mismatches"] == 0


def test_the_lookup_table_is_made_once_per_dtype_and_device():
    """Building it copies a list to the device (a host sync on CUDA): every dequantization must
    reuse one table, and a table first made under inference mode must still serve training."""
    from hone.kernels.nf4_dequant import NF4_LEVELS, nf4_code

    with torch.inference_mode():
        first = nf4_code(torch.bfloat16, "cpu")
    assert nf4_code(torch.bfloat16, torch.device("cpu")) is first and not first.is_inference()
    assert nf4_code(torch.float32, "cpu") is not first
    assert torch.equal(nf4_code(torch.float32, "cpu"), torch.tensor(NF4_LEVELS))
