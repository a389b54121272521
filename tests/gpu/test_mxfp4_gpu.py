"""MXFP4 on CUDA at gpt-oss-20b's expert shapes (32 experts, hidden 2880, gate_up 5760): the
Triton dequantization equals the plain-PyTorch reference bit for bit (and transformers' own
dequantization of the published layout), launches without a host sync, compiles under Inductor
without a graph break, and the quantizer gives on the GPU what it gives on the CPU. Skipped
without a GPU."""

import pytest
import torch

from hone.kernels.mxfp4_dequant import (
    MXFP4_DTYPES,
    mxfp4_dequantize,
    mxfp4_dequantize_reference,
    mxfp4_quantize,
    mxfp4_to_gpt_oss,
)
from hone.kernels.mxfp4_dequant_triton import triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: openai/gpt-oss-20b's expert stacks as its checkpoint holds them: (experts, out, in / 32).
SHAPES = {"gate_up_proj": (32, 5760, 90), "down_proj": (32, 2880, 90)}


def _random_mxfp4(shape, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, device="cuda", generator=gen)
    scales = torch.randint(100, 150, shape, dtype=torch.uint8, device="cuda", generator=gen)
    scales[0, 0, :5] = torch.tensor([0, 1, 2, 253, 254], dtype=torch.uint8)  # subnormal and overflowing scales
    return blocks, scales


@pytest.mark.parametrize("dtype", MXFP4_DTYPES)
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_triton_dequant_equals_reference_bit_for_bit_at_gpt_oss_20b_shapes(name, dtype):
    assert triton_available("cuda")
    blocks, scales = _random_mxfp4(SHAPES[name], seed=len(name))
    got = mxfp4_dequantize(blocks, scales, dtype)
    assert got.shape == (*SHAPES[name][:2], 2880) and got.dtype == dtype
    expected = mxfp4_dequantize_reference(blocks, scales, dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), expected.view(bits))
    del expected
    if dtype == torch.bfloat16:
        convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
        assert torch.equal(mxfp4_to_gpt_oss(blocks, scales, dtype), convert(blocks, scales, dtype=dtype))


def test_dequant_launches_without_a_host_sync_and_compiles_without_a_graph_break():
    blocks, scales = _random_mxfp4((4, 5760, 90), seed=3)
    mxfp4_dequantize(blocks, scales)  # compile the kernel first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mxfp4_dequantize(blocks, scales)
    finally:
        torch.cuda.set_sync_debug_mode(0)

    def fn(blocks, scales, x):
        return x @ mxfp4_dequantize(blocks, scales, torch.bfloat16)[0].t()

    x = torch.randn(8, 2880, device="cuda", dtype=torch.bfloat16)
    assert torch._dynamo.explain(fn)(blocks, scales, x).graph_break_count == 0
    compiled = torch.compile(fn, fullgraph=True)
    # the op is exact (the test above); the matmul around it may take another cuBLAS path when compiled.
    # Row 0's overflowing scales (253, 254) give inf weights, so output column 0 is NaN on both sides.
    torch.testing.assert_close(compiled(blocks, scales, x), x @ out[0].t(), equal_nan=True)


def test_quantizer_gives_on_the_gpu_what_it_gives_on_the_cpu():
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(2, 5760, 2880, generator=gen) * torch.logspace(-4, 0, 5760).unsqueeze(-1)
    cpu_blocks, cpu_scales = mxfp4_quantize(weight)
    blocks, scales = mxfp4_quantize(weight.cuda())
    assert torch.equal(blocks.cpu(), cpu_blocks) and torch.equal(scales.cpu(), cpu_scales)
    assert torch.equal(mxfp4_dequantize(blocks, scales).cpu(), mxfp4_dequantize(cpu_blocks, cpu_scales))
