"""NF4 dequantization: 4-bit NormalFloat weights with double-quantized scales back to bf16/fp32.

The storage layout is torchao's ``NF4Tensor`` (QLoRA's NF4 with double quantization):

- ``packed`` (uint8, ``numel / 2``): two consecutive 4-bit codes per byte, high nibble first;
- ``scalers`` (int8, ``numel / block_size``): each block's absmax scale, quantized to int8
  after subtracting ``mean``;
- ``factors`` (weight dtype, ``numel / (block_size * scaler_block_size)``): the int8
  quantization factor of each group of ``scaler_block_size`` scales;
- ``mean`` (weight dtype, a scalar): the mean of the scales.

``weight[i] = code[packed nibble i] * (scalers[b] / factors[b // scaler_block_size] + mean)``
with ``b = i // block_size``, each operation rounded to the weight's dtype as torchao does it.

:func:`nf4_dequantize` is the ``torch.library`` custom op ``hone::nf4_dequantize`` with a fake
implementation; its inside runs the Triton kernel (:mod:`hone.kernels.nf4_dequant_triton`) on
CUDA and :func:`nf4_dequantize_reference` (plain PyTorch, torchao's arithmetic) elsewhere.

:func:`nf4_linear` is the frozen 4-bit layer's ``x @ W.T`` as one custom op
(``hone::nf4_linear``) with an autograd formula (``hone::nf4_linear_input_grad``, which
dequantizes again): a compiled QLoRA layer has no graph break, and the dequantized weight never
appears in the traced graph, so neither the compiler's common-subexpression elimination nor its
partitioner can turn it into a saved activation (a bf16 copy of every weight kept for the
backward would undo the 4-bit saving). What autograd saves is the 4-bit components themselves.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from hone.kernels.nf4_dequant_triton import nf4_dequantize_triton, triton_available

#: The 16 NF4 levels (quantiles of a standard normal, normalised to [-1, 1]; QLoRA, Dettmers et
#: al. 2023), as torchao stores them before rounding to the weight dtype.
NF4_LEVELS: tuple[float, ...] = (
    -1.0,
    -0.6962,
    -0.5251,
    -0.3949,
    -0.2844,
    -0.1848,
    -0.0911,
    0.0,
    0.0796,
    0.1609,
    0.2461,
    0.3379,
    0.4407,
    0.5626,
    0.7230,
    1.0,
)


def nf4_code(dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The NF4 levels rounded to ``dtype`` (the lookup table of the dequantization), made once per
    dtype and device: building it copies a Python list to the device, a host sync that, on every
    dequantization (two per linear layer and step), left the GPU idle (756 syncs a qwen3-8b QLoRA
    step). Treat it as read-only."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _nf4_code(dtype, device)


@functools.lru_cache(maxsize=16)
def _nf4_code(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():  # a normal tensor, whatever mode asks first
        return torch.tensor(NF4_LEVELS, dtype=dtype, device=device)


def nf4_dequantize_reference(
    packed: torch.Tensor,
    scalers: torch.Tensor,
    factors: torch.Tensor,
    mean: torch.Tensor,
    block_size: int,
    scaler_block_size: int,
    out_features: int,
    in_features: int,
) -> torch.Tensor:
    """Plain-PyTorch dequantization with torchao's order of operations (the parity reference)."""
    dtype = factors.dtype
    code = nf4_code(dtype, packed.device)
    scales = (scalers.view(-1, scaler_block_size) / factors.unsqueeze(-1)).flatten().to(dtype) + mean
    scales = scales.repeat_interleave(block_size // 2)
    high = code[(packed >> 4).long()] * scales
    low = code[(packed & 15).long()] * scales
    return torch.stack([high, low], dim=-1).reshape(out_features, in_features)


@torch.library.custom_op("hone::nf4_dequantize", mutates_args=())
def _nf4_dequantize_op(
    packed: torch.Tensor,
    scalers: torch.Tensor,
    factors: torch.Tensor,
    mean: torch.Tensor,
    block_size: int,
    scaler_block_size: int,
    out_features: int,
    in_features: int,
) -> torch.Tensor:
    if triton_available(packed.device):
        code = nf4_code(factors.dtype, packed.device)
        flat = nf4_dequantize_triton(packed, scalers, factors, mean, code, block_size, scaler_block_size)
        return flat.view(out_features, in_features)
    return nf4_dequantize_reference(packed, scalers, factors, mean, block_size, scaler_block_size, out_features, in_features)


@_nf4_dequantize_op.register_fake
def _(packed, scalers, factors, mean, block_size, scaler_block_size, out_features, in_features):
    return packed.new_empty((out_features, in_features), dtype=factors.dtype)


def nf4_dequantize(
    packed: torch.Tensor,
    scalers: torch.Tensor,
    factors: torch.Tensor,
    mean: torch.Tensor,
    block_size: int,
    scaler_block_size: int,
    out_features: int,
    in_features: int,
) -> torch.Tensor:
    """The ``[out_features, in_features]`` weight in ``factors.dtype`` (see the module docstring).

    Bit for bit torchao's ``NF4Tensor.get_original_weight()`` on the same components."""
    return _nf4_dequantize_op(packed, scalers, factors, mean, block_size, scaler_block_size, out_features, in_features)


@torch.library.custom_op("hone::nf4_linear", mutates_args=())
def _nf4_linear_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    scalers: torch.Tensor,
    factors: torch.Tensor,
    mean: torch.Tensor,
    block_size: int,
    scaler_block_size: int,
    out_features: int,
    in_features: int,
) -> torch.Tensor:
    weight = _nf4_dequantize_op(packed, scalers, factors, mean, block_size, scaler_block_size, out_features, in_features)
    return F.linear(x.to(weight.dtype), weight)


@_nf4_linear_op.register_fake
def _(x, packed, scalers, factors, mean, block_size, scaler_block_size, out_features, in_features):
    return x.new_empty((*x.shape[:-1], out_features), dtype=factors.dtype)


@register_flop_formula(torch.ops.hone.nf4_linear)
def _nf4_linear_flops(
    x, packed, scalers, factors, mean, block_size, scaler_block_size, out_features, in_features, **kwargs
) -> int:
    """``x @ W.T``'s FLOPs (the dequantization's are a rounding error beside them): without a
    formula torch's flop counter counts the opaque op as 0 and Inductor's memory-budget
    partitioner recomputed the frozen 4-bit projections first, as if free
    (:func:`hone.transforms.checkpointing.memory_budget_context`)."""
    return 2 * math.prod(x[:-1]) * in_features * out_features


@torch.library.custom_op("hone::nf4_linear_input_grad", mutates_args=())
def _nf4_linear_input_grad(
    grad: torch.Tensor,
    packed: torch.Tensor,
    scalers: torch.Tensor,
    factors: torch.Tensor,
    mean: torch.Tensor,
    block_size: int,
    scaler_block_size: int,
    out_features: int,
    in_features: int,
    input_dtype: torch.dtype,
) -> torch.Tensor:
    weight = _nf4_dequantize_op(packed, scalers, factors, mean, block_size, scaler_block_size, out_features, in_features)
    return (grad.to(weight.dtype) @ weight).to(input_dtype)


@_nf4_linear_input_grad.register_fake
def _(grad, packed, scalers, factors, mean, block_size, scaler_block_size, out_features, in_features, input_dtype):
    return grad.new_empty((*grad.shape[:-1], in_features), dtype=input_dtype)


def _linear_setup_context(ctx, inputs, output) -> None:
    x, packed, scalers, factors, mean, block_size, scaler_block_size, out_features, in_features = inputs
    ctx.save_for_backward(packed, scalers, factors, mean)
    ctx.sizes = (block_size, scaler_block_size, out_features, in_features)
    ctx.input_dtype = x.dtype


def _linear_backward(ctx, grad):
    grad_x = None
    if ctx.needs_input_grad[0]:
        packed, scalers, factors, mean = ctx.saved_tensors
        grad_x = _nf4_linear_input_grad(grad, packed, scalers, factors, mean, *ctx.sizes, ctx.input_dtype)
    return grad_x, None, None, None, None, None, None, None, None


_nf4_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


def nf4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scalers: torch.Tensor,
    factors: torch.Tensor,
    mean: torch.Tensor,
    block_size: int,
    scaler_block_size: int,
    out_features: int,
    in_features: int,
) -> torch.Tensor:
    """``x @ W.T`` in ``factors.dtype`` for the NF4 weight ``W`` (no bias); differentiable in
    ``x`` only (the 4-bit weight is frozen). ``x`` is cast to the weight's dtype, and its gradient
    comes back in ``x``'s dtype."""
    return _nf4_linear_op(x, packed, scalers, factors, mean, block_size, scaler_block_size, out_features, in_features)
