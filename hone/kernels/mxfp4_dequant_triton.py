"""Triton kernel of the MXFP4 dequantization (:mod:`hone.kernels.mxfp4_dequant`).

One program turns ``BLOCK`` packed bytes into ``2 * BLOCK`` values. Byte ``b`` holds elements
``2b`` (low nibble) and ``2b + 1`` (high nibble); every 16 bytes (32 values) share one E8M0
scale byte. A value is decoded arithmetically (no lookup table, so nothing to copy to the device
first): twice an E2M1 magnitude is ``m`` for exponent field 0 and ``(2 + m) << (e - 1)``
otherwise, and the scale is a float32 built from its bits. The product is exact in float32 (and
in bf16), and one cast rounds it to the output dtype, as :func:`~hone.kernels.mxfp4_dequant.mxfp4_dequantize_reference`
does: the two agree bit for bit.
"""

from __future__ import annotations

import torch

from hone.kernels.triton_support import tl, triton, triton_available  # noqa: F401 (re-exported)

#: Packed bytes per program: 2,048 values (64 scale blocks), 11,520 programs for one gpt-oss-20b
#: layer's gate_up stack (32 x 5760 x 2880).
BLOCK_BYTES = 1024


if triton is not None:

    @triton.jit
    def e2m1_value(code):
        """The float32 value of 4-bit codes (int32, 0..15): bit 3 the sign, bits 2..1 the
        exponent field, bit 0 the mantissa."""
        exponent = (code >> 1) & 3
        mantissa = code & 1
        twice = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0))
        magnitude = twice.to(tl.float32) * 0.5
        # the sign as a bit (code 8 is -0.0, as the published table has it; ``-x`` may compile to ``0 - x``, +0.0)
        signed = magnitude.to(tl.int32, bitcast=True) | ((code & 8) << 28)
        return signed.to(tl.float32, bitcast=True)

    @triton.jit
    def _to_output(x, IS_BF16: tl.constexpr, out_dtype: tl.constexpr):
        """``x`` (float32) in the output dtype. A value here has two significant bits and an
        exponent bf16 holds, subnormals included, so its bf16 bits are its float32 bits' upper
        half: taken as such, also under Triton's interpreter, whose bf16 cast flushes subnormals."""
        if IS_BF16:
            return (x.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(out_dtype)

    @triton.jit
    def _mxfp4_dequant_kernel(blocks_ptr, scales_ptr, out_ptr, n_bytes, BLOCK: tl.constexpr, IS_BF16: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_bytes
        byte = tl.load(blocks_ptr + offs, mask=mask, other=0).to(tl.int32)
        s = tl.load(scales_ptr + offs // 16, mask=mask, other=127).to(tl.int32)
        # E8M0 -> float32 bits: 0 is the subnormal 2**-127, 255 is NaN, else s is the exponent field
        bits = tl.where(s == 0, 0x00400000, tl.where(s == 255, 0x7FC00000, s << 23))
        scale = bits.to(tl.float32, bitcast=True)
        out_dtype = out_ptr.dtype.element_ty
        low = _to_output(e2m1_value(byte & 15) * scale, IS_BF16, out_dtype)
        high = _to_output(e2m1_value(byte >> 4) * scale, IS_BF16, out_dtype)
        # byte i holds values 2i (low nibble) and 2i+1: one contiguous store of 2 * BLOCK values
        values = tl.interleave(low, high)
        out_offs = pid.to(tl.int64) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
        tl.store(out_ptr + out_offs, values, mask=out_offs < 2 * n_bytes)


def mxfp4_dequantize_triton(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The flat dequantized weight (``2 * blocks.numel()`` values in ``dtype``) of contiguous
    ``blocks [..., n_blocks, 16]`` and ``scales [..., n_blocks]``."""
    n_bytes = blocks.numel()
    out = torch.empty(2 * n_bytes, dtype=dtype, device=blocks.device)
    if n_bytes:
        grid = (triton.cdiv(n_bytes, BLOCK_BYTES),)
        _mxfp4_dequant_kernel[grid](blocks, scales, out, n_bytes, BLOCK=BLOCK_BYTES, IS_BF16=dtype == torch.bfloat16)
    return out
