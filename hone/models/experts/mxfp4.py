"""MXFP4 experts on a transformers experts module: blocks and scales instead of a bf16 weight.

An experts module keeps its class, its flags and its place in the model (transformers' experts
interface still dispatches it; PEFT's ``target_parameters`` still wraps it). Only the storage
of ``gate_up_proj`` / ``down_proj`` changes:

- the checkpoint's ``{name}_blocks`` (uint8 ``[E, out, in / 32, 16]``) and ``{name}_scales``
  (uint8 ``[E, out, in / 32]``) become **buffers** of the module (non-persistent: nothing of
  the frozen base is ever written to a checkpoint or an optimizer; an adapter saves as usual);
- the parameter ``{name}`` becomes a **placeholder**: a tensor of the parameter's shape and dtype
  whose every element is one scalar (all strides zero, 2 bytes). PEFT reads its shape to size
  the expert LoRA factors and its device and dtype to place them; the experts forward
  (:func:`hone.models.experts.backend.hone_experts_forward`) reads the buffers, never the
  placeholder. :func:`dequantize_experts` turns the module back into an ordinary one (merging,
  generation with transformers' experts).

The layout is always ``[E, out, in]`` (blocks along the contraction dimension ``in``), whatever
the module's ``is_transposed`` says of its bf16 parameters: gpt-oss ships it so, and
:func:`quantize_experts` writes it so for any MoE (qwen3-moe's ``[E, out, in]`` parameters
as they are, gpt-oss' ``[E, in, out]`` transposed).
"""

from __future__ import annotations

import torch
from torch import nn

from hone.kernels.mxfp4_dequant import MXFP4_BLOCK, MXFP4_BLOCK_BYTES, mxfp4_dequantize, mxfp4_quantize
from hone.models.errors import ModelError

#: The experts' projections MXFP4 stores (transformers' parameter names).
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
#: Bytes per weight in MXFP4: half a byte of code plus one scale byte per 32 weights.
MXFP4_BYTES_PER_WEIGHT = 0.5 + 1 / MXFP4_BLOCK
#: Experts quantized at once by :func:`quantize_experts` (bounds the quantizer's float32 temporaries).
_EXPERTS_PER_CHUNK = 8

MxExperts = tuple[torch.Tensor, torch.Tensor]


def quant_method(config: object) -> str | None:
    """The ``quantization_config.quant_method`` of a transformers config (``"mxfp4"`` for gpt-oss
    as shipped), or None for an unquantized checkpoint; the config may hold it as a dict or an object."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    return None if method is None else str(getattr(method, "value", method))


def is_mxfp4_config(config: object) -> bool:
    """Whether a checkpoint with this config ships its experts in MXFP4 (blocks + scales)."""
    return quant_method(config) == "mxfp4"


def placeholder(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """A frozen parameter of ``shape`` backed by one element (every stride 0): what PEFT and
    transformers read of an MXFP4 weight (shape, dtype, device) without its bf16 bytes."""
    return nn.Parameter(torch.zeros((), dtype=dtype, device=device).expand(shape), requires_grad=False)


def is_placeholder(tensor: torch.Tensor) -> bool:
    return tensor.dim() > 0 and tensor.numel() > 1 and all(stride == 0 for stride in tensor.stride())


def out_in_shape(module: nn.Module, name: str) -> tuple[int, int, int]:
    """``(E, out, in)`` of projection ``name`` of ``module``, from its parameter's shape."""
    experts, first, second = getattr(module, name).shape
    return (experts, second, first) if getattr(module, "is_transposed", False) else (experts, first, second)


def mxfp4_weights(module: nn.Module) -> dict[str, MxExperts]:
    """``{projection: (blocks, scales)}`` of the projections ``module`` holds in MXFP4 (empty: none)."""
    found = {}
    for name in EXPERT_PROJECTIONS:
        blocks = getattr(module, name + BLOCKS_SUFFIX, None)
        scales = getattr(module, name + SCALES_SUFFIX, None)
        if isinstance(blocks, torch.Tensor) and isinstance(scales, torch.Tensor):
            found[name] = (blocks, scales)
    return found


def has_mxfp4_experts(model: nn.Module) -> bool:
    return any(mxfp4_weights(module) for module in model.modules())


def check_mxfp4_shapes(where: str, expected: tuple[int, int, int], blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Refuse blocks / scales that do not hold an ``[E, out, in]`` MXFP4 weight, naming ``where``
    (the checkpoint tensor or the module), both shapes and the shapes expected."""
    experts, out, inputs = expected
    want_blocks = (experts, out, inputs // MXFP4_BLOCK, MXFP4_BLOCK_BYTES)
    want_scales = want_blocks[:3]
    if inputs % MXFP4_BLOCK:
        raise ModelError(f"{where}: MXFP4 needs an input width that is a multiple of {MXFP4_BLOCK}, got {inputs}")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelError(f"{where}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if tuple(blocks.shape) != want_blocks or tuple(scales.shape) != want_scales:
        raise ModelError(
            f"{where}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not hold the experts' "
            f"[experts, out, in] = {list(expected)} weight: expected blocks {want_blocks} and scales {want_scales}"
        )


def attach_mxfp4(module: nn.Module, name: str, blocks: torch.Tensor, scales: torch.Tensor, where: str = "") -> None:
    """Make ``module.<name>`` an MXFP4 weight: ``blocks`` / ``scales`` as buffers, the parameter a
    placeholder of its shape and dtype on the blocks' device (``where`` names the module in errors)."""
    param = getattr(module, name)
    check_mxfp4_shapes(where or f"{type(module).__name__}.{name}", out_in_shape(module, name), blocks, scales)
    module.register_buffer(name + BLOCKS_SUFFIX, blocks, persistent=False)
    module.register_buffer(name + SCALES_SUFFIX, scales, persistent=False)
    setattr(module, name, placeholder(param.shape, param.dtype, blocks.device))


@torch.no_grad()
def quantize_experts(module: nn.Module, device: torch.device) -> int:
    """Quantize ``module``'s expert projections to MXFP4 on ``device`` (a few experts at a time,
    so the quantizer's float32 temporaries stay small); returns the weights quantized."""
    count = 0
    for name in EXPERT_PROJECTIONS:
        if name in mxfp4_weights(module):
            continue
        weight = getattr(module, name)
        transposed = bool(getattr(module, "is_transposed", False))
        blocks, scales = [], []
        for first in range(0, weight.shape[0], _EXPERTS_PER_CHUNK):
            chunk = weight[first : first + _EXPERTS_PER_CHUNK].to(device)
            b, s = mxfp4_quantize(chunk.transpose(1, 2) if transposed else chunk)
            blocks.append(b)
            scales.append(s)
        count += weight.numel()
        attach_mxfp4(module, name, torch.cat(blocks), torch.cat(scales))
    return count


@torch.no_grad()
def dequantize_experts(module: nn.Module, dtype: torch.dtype) -> None:
    """Give ``module`` ordinary frozen ``dtype`` parameters again (the exact dequantized values,
    in the module's own layout) and drop its MXFP4 buffers."""
    for name, (blocks, scales) in mxfp4_weights(module).items():
        weight = mxfp4_dequantize(blocks, scales, dtype)  # [E, out, in]
        if getattr(module, "is_transposed", False):
            weight = weight.transpose(1, 2)
        delattr(module, name + BLOCKS_SUFFIX)
        delattr(module, name + SCALES_SUFFIX)
        setattr(module, name, nn.Parameter(weight.contiguous(), requires_grad=False))


def dequantize_model_experts(model: nn.Module, dtype: torch.dtype) -> int:
    """:func:`dequantize_experts` on every MXFP4 experts module of ``model``; returns how many."""
    modules = [module for module in model.modules() if mxfp4_weights(module)]
    for module in modules:
        dequantize_experts(module, dtype)
    return len(modules)


def mxfp4_bytes(model: nn.Module) -> int:
    """Bytes the MXFP4 blocks and scales of ``model`` take."""
    return sum(b.numel() + s.numel() for module in model.modules() for b, s in mxfp4_weights(module).values())


def mxfp4_state_names(model: nn.Module) -> list[str]:
    """Names (as ``model.named_parameters`` / ``named_buffers`` give them) of the MXFP4 blocks,
    scales and placeholders: frozen tensors every process builds identically (same checkpoint, or
    the same seeded draw and quantizer), which data parallelism must not broadcast (a placeholder
    cannot be written; the blocks are gigabytes)."""
    names = [name for name, param in model.named_parameters() if is_placeholder(param)]
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for projection in mxfp4_weights(module):
            names += [prefix + projection + BLOCKS_SUFFIX, prefix + projection + SCALES_SUFFIX]
    return names
