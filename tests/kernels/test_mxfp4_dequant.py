"""MXFP4: hone's quantizer and dequantizer follow the published gpt-oss layout and OCP MX v1.0.

The format is checked against transformers' own MXFP4 dequantization (the code that reads the
published checkpoints) and hone's quantizer against torchao's OCP implementation, bit for bit.
The Triton kernel runs under Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must
be set before triton is imported), skipped where triton is not installed;
tests/gpu/test_mxfp4_gpu.py checks it at gpt-oss-20b's shapes."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from interpreted import run_interpreted

from hone.kernels.mxfp4_dequant import (
    E2M1_VALUES,
    MXFP4_DTYPES,
    mxfp4_dequantize,
    mxfp4_dequantize_reference,
    mxfp4_quantize,
    mxfp4_to_gpt_oss,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mxfp4_checkpoint import GPT_OSS_QUANTIZATION_CONFIG, write_mxfp4_gpt_oss  # noqa: E402


def _random_mxfp4(shape, seed, low=100, high=150):
    """Random blocks (every code) and scales for a ``[*shape, n_blocks]`` tensor."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(low, high, shape, dtype=torch.uint8, generator=gen)
    return blocks, scales


def test_code_table_nibble_order_and_e8m0_scale():
    # byte 0x21: element 0 = low nibble (code 1 = 0.5), element 1 = high nibble (code 2 = 1.0)
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x21
    blocks[0, 0, 1] = 0xF8  # element 2: code 8 = -0.0, element 3: code 15 = -6
    for scale, factor in ((127, 1.0), (128, 2.0), (125, 0.25)):
        out = mxfp4_dequantize(blocks, torch.full((1, 1), scale, dtype=torch.uint8), torch.float32)
        assert out.shape == (1, 32)
        assert out[0, :4].tolist() == [0.5 * factor, 1.0 * factor, -0.0, -6.0 * factor]
        assert torch.signbit(out[0, 2]) and not torch.signbit(out[0, 4])
    # every code, every nibble: the E2M1 table of the OCP spec (sign = bit 3)
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes | (codes.flip(0) << 4)).reshape(1, 16)[None]
    out = mxfp4_dequantize(blocks, torch.full((1, 1), 127, dtype=torch.uint8), torch.float32)[0]
    assert out[0::2].tolist() == list(E2M1_VALUES) and out[1::2].tolist() == list(E2M1_VALUES[::-1])
    assert E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert all(v == -E2M1_VALUES[i] for i, v in enumerate(E2M1_VALUES[8:]))
    # E8M0: 2**(s - 127); 0 is the subnormal 2**-127, 254 is 2**127, 255 is NaN
    ones = torch.full((1, 5, 16), 0x22, dtype=torch.uint8)  # every value 1.0
    scales = torch.tensor([[0, 1, 127, 254, 255]], dtype=torch.uint8)
    out = mxfp4_dequantize(ones, scales, torch.float32).view(5, 32)
    assert out[:4, 0].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0**127]
    assert torch.isnan(out[4]).all()


@pytest.mark.parametrize("dtype", MXFP4_DTYPES)
def test_equals_transformers_dequantization_of_published_layout(dtype):
    convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
    blocks, scales = _random_mxfp4((4, 96, 3), seed=1)  # 4 experts, 96 outputs, 96 inputs
    expected = convert(blocks, scales, dtype=dtype)
    ours = mxfp4_to_gpt_oss(blocks, scales, dtype)
    assert ours.shape == expected.shape == (4, 96, 96) and ours.dtype == dtype
    assert torch.equal(ours, expected)
    assert torch.equal(ours, mxfp4_dequantize(blocks, scales, dtype).transpose(-1, -2))


def test_quantizer_equals_torchao_ocp_conversion():
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    config = pytest.importorskip("torchao.prototype.mx_formats.config")
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 256, generator=gen) * 0.02
    weight[0, :12] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.5, -0.25, -5.0, -7.5])  # ties, saturation
    weight[1, :32] = 0.0
    scale, packed = mx.to_mx(weight, torch.float4_e2m1fn_x2, 32, config.ScaleCalculationMode.FLOOR)
    blocks, scales = mxfp4_quantize(weight)
    assert torch.equal(scales, scale.view(torch.uint8).reshape(scales.shape))
    assert torch.equal(blocks.reshape(64, 128), packed.view(torch.uint8))
    # ties to even, saturation at 6 (the row's scale is 1)
    assert mxfp4_dequantize(blocks, scales, torch.float32)[0, :12].tolist() == [
        0.0,
        1.0,
        1.0,
        2.0,
        2.0,
        4.0,
        4.0,
        6.0,
        6.0,
        -0.0,
        -4.0,
        -6.0,
    ]


@pytest.mark.parametrize("shape", [(32,), (5, 64), (3, 7, 96)])
def test_layout_of_quantized_weight(shape):
    blocks, scales = mxfp4_quantize(torch.randn(shape))
    assert blocks.dtype == scales.dtype == torch.uint8
    assert blocks.shape == (*shape[:-1], shape[-1] // 32, 16) and scales.shape == (*shape[:-1], shape[-1] // 32)
    assert blocks.is_contiguous() and scales.is_contiguous()
    assert mxfp4_dequantize(blocks, scales).shape == shape


def test_representable_values_round_trip_bit_exactly():
    blocks, scales = _random_mxfp4((6, 40, 5), seed=3, low=90, high=160)
    # a block's scale is the quantizer's choice only when its largest magnitude is 4 or 6 (codes 6, 7)
    blocks[..., 0] = (blocks[..., 0] & 0xF0) | torch.randint(6, 8, blocks.shape[:-1], dtype=torch.uint8)
    blocks[0, 0, 0] = 0x86  # a -0.0 survives as -0.0
    values = mxfp4_dequantize(blocks, scales, torch.float32)
    again_blocks, again_scales = mxfp4_quantize(values)
    assert torch.equal(again_blocks, blocks) and torch.equal(again_scales, scales)
    # any representable value comes back as itself (a block with a smaller maximum gets a smaller scale)
    blocks, scales = _random_mxfp4((6, 40, 5), seed=4)
    values = mxfp4_dequantize(blocks, scales, torch.float32)
    again = mxfp4_dequantize(*mxfp4_quantize(values), torch.float32)
    assert torch.equal(again.view(torch.int32), values.view(torch.int32))
    for dtype in (torch.bfloat16, torch.float16):  # values of the weight's own dtype
        narrow = mxfp4_dequantize(blocks, torch.full_like(scales, 120), dtype)
        assert torch.equal(mxfp4_dequantize(*mxfp4_quantize(narrow), dtype), narrow)


def test_random_weights_error_is_at_most_half_a_step_of_the_block_scale():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 512, generator=gen) * torch.logspace(-6, 1, 64).unsqueeze(-1)
    blocks, scales = mxfp4_quantize(weight)
    got = mxfp4_dequantize(blocks, scales, torch.float32).unflatten(-1, (-1, 32))
    weight = weight.unflatten(-1, (-1, 32))
    scale = torch.exp2(scales.float() - 127).unsqueeze(-1)
    amax = weight.abs().amax(-1, keepdim=True)
    assert torch.equal(scale, torch.exp2(torch.floor(torch.log2(amax)) - 2))  # OCP: floor(log2(amax)) - emax
    scaled = (weight / scale).abs()
    half_step = torch.where(scaled < 2, 0.25, torch.where(scaled < 4, 0.5, 1.0)) * scale
    inside = scaled <= 6
    assert ((got - weight).abs() <= half_step)[inside].all()
    assert torch.equal(got[~inside], torch.sign(weight[~inside]) * 6 * scale.expand_as(weight)[~inside])  # saturated
    assert (~inside).any() and inside.any()


def test_bad_inputs_name_both_shapes():
    blocks, scales = _random_mxfp4((4, 8, 3), seed=6)
    with pytest.raises(ValueError, match=r"blocks \(4, 8, 3, 16\) and scales \(4, 8, 2\) disagree"):
        mxfp4_dequantize(blocks, scales[..., :2])
    with pytest.raises(ValueError, match=r"blocks \(4, 8, 3, 8\) and scales \(4, 8, 3\)"):
        mxfp4_dequantize(blocks[..., :8], scales)
    with pytest.raises(ValueError, match=r"uint8, got blocks torch.int8 \(4, 8, 3, 16\) and scales torch.uint8 \(4, 8, 3\)"):
        mxfp4_dequantize(blocks.view(torch.int8), scales)
    with pytest.raises(ValueError, match=r"scales torch.float32 \(4, 8, 3\)"):
        mxfp4_dequantize(blocks, scales.float())
    with pytest.raises(ValueError, match="got torch.int32"):
        mxfp4_dequantize(blocks, scales, torch.int32)
    with pytest.raises(ValueError, match=r"\(4, 33\).*multiple of 32"):
        mxfp4_quantize(torch.randn(4, 33))
    with pytest.raises(ValueError, match="inf or NaN"):
        mxfp4_quantize(torch.tensor([float("inf")] + [0.0] * 31))


def test_op_fake_impl_and_compile_without_graph_break():
    blocks, scales = _random_mxfp4((2, 16, 4), seed=7)
    torch.library.opcheck(torch.ops.hone.mxfp4_dequantize.default, (blocks, scales, torch.bfloat16))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mxfp4_dequantize(mode.from_tensor(blocks), mode.from_tensor(scales), torch.float16)
    assert fake.shape == (2, 16, 128) and fake.dtype == torch.float16

    def fn(blocks, scales, x):
        return x @ mxfp4_dequantize(blocks, scales, torch.float32).transpose(-1, -2)

    x = torch.randn(2, 3, 128)
    assert torch._dynamo.explain(fn)(blocks, scales, x).graph_break_count == 0
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(blocks, scales, x), fn(blocks, scales, x))


def test_checkpoint_helper_writes_the_published_layout(tmp_path):
    from safetensors import safe_open

    checkpoint = write_mxfp4_gpt_oss(tmp_path / "ckpt", overrides={"intermediate_size": 64})  # gate_up not square
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["quantization_config"] == GPT_OSS_QUANTIZATION_CONFIG and config["model_type"] == "gpt_oss"
    experts, hidden, inter = 8, 64, 64
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        prefix = "model.layers.1.mlp.experts."
        expected = {
            "gate_up_proj_blocks": ((experts, 2 * inter, hidden // 32, 16), torch.uint8),
            "gate_up_proj_scales": ((experts, 2 * inter, hidden // 32), torch.uint8),
            "gate_up_proj_bias": ((experts, 2 * inter), torch.bfloat16),
            "down_proj_blocks": ((experts, hidden, inter // 32, 16), torch.uint8),
            "down_proj_scales": ((experts, hidden, inter // 32), torch.uint8),
            "down_proj_bias": ((experts, hidden), torch.bfloat16),
        }
        for suffix, (shape, dtype) in expected.items():
            tensor = f.get_tensor(prefix + suffix)
            assert tensor.shape == shape and tensor.dtype == dtype, suffix
        for proj in ("gate_up_proj", "down_proj"):
            name = prefix + proj
            assert name not in names
            dequantized = mxfp4_to_gpt_oss(f.get_tensor(name + "_blocks"), f.get_tensor(name + "_scales"), torch.float32)
            original = checkpoint.weights[name]
            assert torch.equal(dequantized, checkpoint.experts[name])
            assert torch.equal(dequantized, mxfp4_dequantize(*mxfp4_quantize(original.transpose(-1, -2)), torch.float32).mT)
        assert f.get_tensor("model.layers.0.self_attn.sinks").dtype == torch.bfloat16
        assert torch.equal(f.get_tensor("lm_head.weight"), checkpoint.weights["lm_head.weight"].bfloat16())


def test_transformers_reads_the_written_checkpoint_as_hone_dequantizes_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    checkpoint = write_mxfp4_gpt_oss(tmp_path, overrides={"intermediate_size": 64})
    model = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16
    )
    state = model.state_dict()
    assert len(checkpoint.experts) == 4
    for name, expected in checkpoint.experts.items():
        assert state[name].shape == expected.shape
        assert torch.equal(state[name].float(), expected), name
    for name in ("model.layers.0.mlp.experts.down_proj_bias", "model.layers.1.mlp.router.weight"):
        assert torch.equal(state[name].float(), checkpoint.weights[name].bfloat16().float())


_CHECKS = r"""
import json
import torch
from hone.kernels.mxfp4_dequant import MXFP4_DTYPES, mxfp4_dequantize, mxfp4_dequantize_reference
from hone.kernels.mxfp4_dequant_triton import mxfp4_dequantize_triton

gen = torch.Generator().manual_seed(0)
# 3 x 70 x 11 blocks of 16 bytes: 36,960 bytes, 37 programs of 1024 (the last one partial)
blocks = torch.randint(0, 256, (3, 70, 11, 16), dtype=torch.uint8, generator=gen)
scales = torch.randint(100, 150, (3, 70, 11), dtype=torch.uint8, generator=gen)
scales[0, 0, :6] = torch.tensor([0, 1, 2, 253, 254, 255], dtype=torch.uint8)  # subnormal, overflow, NaN
out = {}
for dtype in MXFP4_DTYPES:
    expected = mxfp4_dequantize_reference(blocks, scales, dtype)
    flat = mxfp4_dequantize_triton(blocks, scales, dtype)
    op = mxfp4_dequantize(blocks, scales, dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16

    def mismatches(got):
        # bit for bit, except that any NaN equals any NaN (a NaN's sign and payload carry no value)
        nan = torch.isnan(got) & torch.isnan(expected)
        return int(((got.view(bits) != expected.view(bits)) & ~nan).sum())

    out[str(dtype)] = {
        "mismatches": mismatches(flat.view(expected.shape)),
        "op_mismatches": mismatches(op),
        "nan_is_the_0xff_block": bool(torch.equal(torch.isnan(flat.view(expected.shape)), torch.isnan(expected)))
        and int(torch.isnan(expected).sum()) == 32,
        "dtype": str(flat.dtype),
        "numel": flat.numel(),
    }
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (CPU-only torch); the GPU tests cover the kernel")
    return run_interpreted(["-c", _CHECKS])


@pytest.mark.parametrize("dtype", [str(d) for d in MXFP4_DTYPES])
def test_triton_kernel_equals_reference_bit_for_bit(interpreted, dtype):
    result = interpreted[dtype]
    assert result["dtype"] == dtype and result["numel"] == 3 * 70 * 11 * 32
    assert result["mismatches"] == 0 and result["op_mismatches"] == 0
    assert result["nan_is_the_0xff_block"]


def test_reference_is_float32_math_then_one_rounding():
    blocks, scales = _random_mxfp4((3, 8, 2), seed=8, low=90, high=170)
    wide = mxfp4_dequantize_reference(blocks, scales, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(mxfp4_dequantize_reference(blocks, scales, dtype), wide.to(dtype))
