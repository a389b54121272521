"""MXFP4 (OCP Microscaling, E2M1 elements with E8M0 block scales): hone's quantizer and dequantizer.

The layout is the one the published gpt-oss checkpoints (openai/gpt-oss-20b, -120b) ship and
transformers' MXFP4 integration (``transformers/integrations/mxfp4.py``,
``convert_moe_packed_tensors``) reads; the number formats are the OCP Microscaling Formats (MX)
v1.0 specification's:

- **Blocks of 32 values along the last (contraction) dimension**, one shared scale each.
- ``*_blocks``: ``uint8 [..., rows, n_blocks, 16]``, 16 bytes = 32 4-bit codes a block. Byte
  ``j`` of a block holds element ``2j`` in its **low** nibble (``byte & 0x0F``) and element
  ``2j + 1`` in its **high** nibble (``byte >> 4``) (transformers writes ``lut[lo]`` to the
  even and ``lut[hi]`` to the odd positions).
- ``*_scales``: ``uint8 [..., rows, n_blocks]``, E8M0: the value ``2 ** (scale - 127)``
  (transformers: ``ldexp(values, scale - 127)``). Per the OCP spec, 0 is ``2 ** -127`` and
  ``0xFF`` is NaN (hone returns NaN for the whole block; no published checkpoint holds it).
- E2M1 codes (1 sign bit = bit 3, 2 exponent bits with bias 1, 1 mantissa bit; no inf/NaN):
  codes 0..7 are ``+0, 0.5, 1, 1.5, 2, 3, 4, 6`` and codes 8..15 the same negated (8 is -0).
- gpt-oss stores each expert projection as ``[experts, out, in / 32, 16]``: in
  openai/gpt-oss-20b ``mlp.experts.gate_up_proj_blocks`` is ``U8 (32, 5760, 90, 16)``,
  ``gate_up_proj_scales`` ``U8 (32, 5760, 90)``, ``down_proj_blocks`` ``U8 (32, 2880, 90, 16)``,
  ``down_proj_scales`` ``U8 (32, 2880, 90)``, and the biases ``gate_up_proj_bias`` /
  ``down_proj_bias`` stay in bf16 (``(32, 5760)`` / ``(32, 2880)``). transformers' gpt-oss
  experts keep ``gate_up_proj [experts, in, out]`` (``x @ W``), so its weight is the
  dequantized ``[experts, out, in]`` tensor transposed over the last two dimensions
  (``convert_moe_packed_tensors`` ends in ``.transpose(1, 2)``); :func:`mxfp4_to_gpt_oss`
  does the same. The gate/up interleaving (gate = even output columns, up = odd) is the
  model's, untouched by the format.

:func:`mxfp4_dequantize` returns the un-transposed ``[..., rows, n_blocks * 32]`` weight. It is
the ``torch.library`` custom op ``hone::mxfp4_dequantize`` with a fake implementation; its
inside runs the Triton kernel (:mod:`hone.kernels.mxfp4_dequant_triton`) on CUDA and
:func:`mxfp4_dequantize_reference` (plain PyTorch) elsewhere. Both compute each value as an
exact float32 product (a code has two significant bits, a scale is a power of two) and round it
once to the output dtype, so they agree bit for bit, and with transformers' bf16 dequantization.

:func:`mxfp4_quantize` is hone's own quantizer, following the OCP spec's conversion (section
6.3): the shared exponent is ``floor(log2(amax)) - 2`` (E2M1's largest exponent is 2), clamped
to E8M0's ``[-127, 127]``; each value divided by the scale is rounded to the nearest E2M1 value,
**ties to even** (the code whose mantissa bit is 0, IEEE roundTiesToEven), and magnitudes beyond
6 saturate to 6 (the spec clamps to the largest normal). An all-zero block gets scale ``2 ** -127``.
"""

from __future__ import annotations

import torch

from hone.kernels.mxfp4_dequant_triton import mxfp4_dequantize_triton, triton_available

#: Values a block holds, and bytes its codes take.
MXFP4_BLOCK = 32
MXFP4_BLOCK_BYTES = 16
#: E8M0's exponent bias: a scale byte ``s`` means ``2 ** (s - 127)``.
E8M0_BIAS = 127
#: The E2M1 value of each 4-bit code (bit 3 is the sign).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: Output dtypes of the dequantization.
MXFP4_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Refuse blocks and scales that do not form one MXFP4 tensor (shapes, dtypes, devices)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must both be uint8, got blocks {blocks.dtype} {tuple(blocks.shape)} "
            f"and scales {scales.dtype} {tuple(scales.shape)}"
        )
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK_BYTES or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} disagree: blocks must be "
            f"[..., rows, n_blocks, {MXFP4_BLOCK_BYTES}] and scales [..., rows, n_blocks] (blocks' shape without its last dim)"
        )
    if blocks.device != scales.device:
        raise ValueError(f"MXFP4 blocks are on {blocks.device} and scales on {scales.device}; both must be on one device")
    if dtype is not None and dtype not in MXFP4_DTYPES:
        raise ValueError(f"MXFP4 dequantizes to one of {[str(d) for d in MXFP4_DTYPES]}, got {dtype}")


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """``2 ** (s - 127)`` in float32, built from its bits: 0 is the subnormal ``2 ** -127``,
    255 is NaN (OCP MX v1.0), every other byte ``s`` is the exponent field itself."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, 0x00400000, torch.where(s == 255, 0x7FC00000, s << 23))
    return bits.view(torch.float32)


def e2m1_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """The E2M1 value of each 4-bit code (an integer tensor of 0..15), in float32."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def mxfp4_dequantize_reference(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Plain-PyTorch dequantization (the parity reference): ``[..., rows, n_blocks * 32]`` in ``dtype``."""
    check_mxfp4(blocks, scales, dtype)
    low = e2m1_to_float32(blocks & 0x0F)
    high = e2m1_to_float32(blocks >> 4)
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., n_blocks, 32]: low nibble first
    values = values * e8m0_to_float32(scales).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


@torch.library.custom_op("hone::mxfp4_dequantize", mutates_args=())
def _mxfp4_dequantize_op(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if triton_available(blocks.device):
        flat = mxfp4_dequantize_triton(blocks.contiguous(), scales.contiguous(), dtype)
        return flat.view(*scales.shape[:-1], scales.shape[-1] * MXFP4_BLOCK)
    return mxfp4_dequantize_reference(blocks, scales, dtype)


@_mxfp4_dequantize_op.register_fake
def _(blocks, scales, dtype):
    return blocks.new_empty((*scales.shape[:-1], scales.shape[-1] * MXFP4_BLOCK), dtype=dtype)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The ``[..., rows, n_blocks * 32]`` weight in ``dtype`` (see the module docstring); a
    ``ValueError`` names both shapes when blocks and scales do not belong together."""
    check_mxfp4(blocks, scales, dtype)
    return _mxfp4_dequantize_op(blocks, scales, dtype)


def mxfp4_to_gpt_oss(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A gpt-oss expert parameter as transformers holds it (``[experts, in, out]``) from its
    checkpoint's ``[experts, out, in / 32, 16]`` blocks and ``[experts, out, in / 32]`` scales."""
    return mxfp4_dequantize(blocks, scales, dtype).transpose(-1, -2).contiguous()


def _round_to_e2m1(scaled: torch.Tensor) -> torch.Tensor:
    """Each ``|value / scale|`` rounded to the nearest E2M1 magnitude, ties to even, saturating at 6."""
    magnitude = scaled.abs()
    # the spacing of E2M1's values: 0.5 below 2, 1 in [2, 4), 2 from 4 on; torch.round ties to even,
    # which at these spacings is the code with mantissa bit 0 (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4)
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return torch.clamp(torch.round(magnitude / step) * step, max=6.0)


#: The code of each E2M1 magnitude, indexed by twice the magnitude (0, 1, 2, 3, 4, 6, 8, 12).
_CODE_OF_TWICE = (0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7)


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of ``weight [..., rows, k]`` (``k`` a multiple of 32) in the published
    layout (``[..., rows, k / 32, 16]`` and ``[..., rows, k / 32]`` uint8), the inverse of
    :func:`mxfp4_dequantize`'s layout; OCP MX v1.0's conversion (see the module docstring)."""
    if weight.dim() < 1 or weight.shape[-1] % MXFP4_BLOCK or weight.shape[-1] == 0:
        raise ValueError(
            f"MXFP4 quantizes blocks of {MXFP4_BLOCK} values along the last dimension: a weight of shape "
            f"{tuple(weight.shape)} has a last dimension that is not a positive multiple of {MXFP4_BLOCK}"
        )
    if not weight.is_floating_point():
        raise ValueError(f"MXFP4 quantizes a floating-point weight, got {weight.dtype} {tuple(weight.shape)}")
    values = weight.detach().float().unflatten(-1, (-1, MXFP4_BLOCK))  # [..., n_blocks, 32]
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"MXFP4 cannot quantize a weight of shape {tuple(weight.shape)} holding inf or NaN")
    amax = values.abs().amax(dim=-1)
    # floor(log2(amax)) exactly: frexp gives amax = m * 2**e with m in [0.5, 1)
    exponent = torch.frexp(amax).exponent - 1 - 2
    exponent = torch.where(amax > 0, exponent, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    scales = (exponent + E8M0_BIAS).to(torch.uint8)
    scaled = values / e8m0_to_float32(scales).unsqueeze(-1)  # division by a power of two: exact
    twice = (_round_to_e2m1(scaled) * 2).long()
    lookup = torch.tensor(_CODE_OF_TWICE, dtype=torch.int32, device=weight.device)
    codes = lookup[twice] | (torch.signbit(values).to(torch.int32) << 3)
    codes = codes.unflatten(-1, (MXFP4_BLOCK_BYTES, 2))
    blocks = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)  # even element in the low nibble
    return blocks.contiguous(), scales.contiguous()
