"""Triton kernel of the NF4 dequantization (:mod:`hone.kernels.nf4_dequant`).

One program turns ``BLOCK`` packed bytes into ``2 * BLOCK`` weights. Each byte holds two
consecutive 4-bit codes (high nibble first, torchao's layout); every ``block_size`` weights
share one int8-quantized scale, every ``scaler_block_size`` scales share one quantization factor
and all share one mean. The arithmetic is done in the same order and with the same roundings as
torchao's ``NF4Tensor.get_original_weight`` (each step rounded to the weight's dtype, the
division correctly rounded with ``div_rn``, not the approximate ``/`` Triton emits by default),
so the result is bit-for-bit the library's.
"""

from __future__ import annotations

import torch

from hone.kernels.triton_support import tl, triton, triton_available  # noqa: F401 (re-exported)

#: Packed bytes per program: 2,048 weights, small enough for many programs on an 8B layer's
#: 4096 x 12288 matrix (12,288 programs) and large enough to amortise the scale loads.
BLOCK_BYTES = 1024


if triton is not None:

    @triton.jit
    def _round(x, IS_BF16: tl.constexpr, out_dtype: tl.constexpr):
        """``x`` (float32) rounded to the output dtype, returned as float32. bfloat16 rounds to
        nearest-even by integer arithmetic on the bits: the same result as the hardware's
        conversion, and also under Triton's interpreter, whose bf16 cast truncates."""
        if IS_BF16:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(out_dtype).to(tl.float32)

    @triton.jit
    def _nf4_dequant_kernel(
        packed_ptr,
        scalers_ptr,
        factor_ptr,
        mean_ptr,
        code_ptr,
        out_ptr,
        n_bytes,
        HALF_BLOCK: tl.constexpr,
        SCALER_BLOCK: tl.constexpr,
        BLOCK: tl.constexpr,
        IS_BF16: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_bytes
        byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
        block = offs // HALF_BLOCK
        out_dtype = out_ptr.dtype.element_ty
        q_scale = tl.load(scalers_ptr + block, mask=mask, other=0).to(tl.float32)
        factor = tl.load(factor_ptr + block // SCALER_BLOCK, mask=mask, other=1.0).to(tl.float32)
        mean = tl.load(mean_ptr).to(tl.float32)
        # torchao: (int8 / factor) in the weight dtype, then + mean in the weight dtype
        scale = _round(tl.math.div_rn(q_scale, factor), IS_BF16, out_dtype)
        scale = _round(scale + mean, IS_BF16, out_dtype)
        high = tl.load(code_ptr + ((byte >> 4) & 15), mask=mask, other=0.0).to(tl.float32)
        low = tl.load(code_ptr + (byte & 15), mask=mask, other=0.0).to(tl.float32)
        # the product of two bf16 values is exact in float32: one rounding, as torch's bf16 multiply
        high = _round(high * scale, IS_BF16, out_dtype).to(out_dtype)
        low = _round(low * scale, IS_BF16, out_dtype).to(out_dtype)
        # byte i holds weights 2i (high nibble) and 2i+1: one contiguous store of 2 * BLOCK values
        values = tl.interleave(high, low)
        out_offs = pid.to(tl.int64) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
        tl.store(out_ptr + out_offs, values, mask=out_offs < 2 * n_bytes)


def nf4_dequantize_triton(
    packed: torch.Tensor,
    scalers: torch.Tensor,
    factors: torch.Tensor,
    mean: torch.Tensor,
    code: torch.Tensor,
    block_size: int,
    scaler_block_size: int,
) -> torch.Tensor:
    """The flat dequantized weight (``2 * packed.numel()`` values in ``code.dtype``)."""
    out = torch.empty(2 * packed.numel(), dtype=code.dtype, device=packed.device)
    n_bytes = packed.numel()
    grid = (triton.cdiv(n_bytes, BLOCK_BYTES),)
    _nf4_dequant_kernel[grid](
        packed,
        scalers,
        factors,
        mean,
        code,
        out,
        n_bytes,
        HALF_BLOCK=block_size // 2,
        SCALER_BLOCK=scaler_block_size,
        BLOCK=BLOCK_BYTES,
        IS_BF16=code.dtype == torch.bfloat16,
    )
    return out
