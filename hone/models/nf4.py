"""QLoRA's frozen 4-bit base: NF4 linear layers and the LoRA layer PEFT puts around them.

Why torchao's NF4 format (not bitsandbytes' ``Linear4bit``): torchao's quantization is plain
PyTorch (it runs and is tested on the CPU, gives the same codes on every device, and needs no
CUDA library to load), its layout is documented tensors (packed codes, int8 scales, factors,
mean) that hone's own dequantization op reads (:mod:`hone.kernels.nf4_dequant`: a
``torch.library`` custom op with a fake implementation, so a compiled decoder layer has no graph
break), and it is what torchtune's FSDP2 QLoRA builds on. bitsandbytes' 4-bit matmul is an
opaque CUDA call that ``torch.compile`` cannot trace without a break, and its quantization
happens when the weight is moved to CUDA. docs/quantization.md has the measurements.

Only the quantization itself comes from torchao (``to_nf4``, when the base is built); the
forward and backward use hone's ops. :class:`NF4Linear` keeps the components as buffers (never
parameters: nothing of the base is trained, so no checkpoint or optimizer ever sees them) and
computes ``x @ dequantize(W).T`` with :func:`hone.kernels.nf4_dequant.nf4_linear`, whose
backward dequantizes again: a bf16 copy of a weight lives only inside one matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from hone.kernels.nf4_dequant import nf4_dequantize, nf4_linear
from hone.models.errors import ModelError

#: Weights per NF4 scale, and scales per int8 quantization factor (QLoRA's and torchao's defaults).
BLOCK_SIZE = 64
SCALER_BLOCK_SIZE = 256

INSTALL_HINT = "pip install 'hone[quant]' (or: pip install torchao)"


def require_torchao():
    """torchao's ``to_nf4``, or a clear error naming the key and the install command."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        raise ModelError(
            f"model.quantize: nf4 needs the Python package 'torchao' (>= 0.18), which is not installed: "
            f"{INSTALL_HINT}, or set model.quantize: none"
        ) from None
    return to_nf4


def torchao_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def nf4_components(nf4: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed codes, int8 scales, factors, mean) of a torchao ``NF4Tensor``."""
    return nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor, nf4.scaler_mean


def can_quantize(linear: nn.Linear) -> bool:
    """Double quantization groups ``BLOCK_SIZE * SCALER_BLOCK_SIZE`` weights (16,384): a layer whose
    size is not a multiple of that stays in the model's dtype (tiny test layers, odd heads)."""
    return linear.weight.numel() % (BLOCK_SIZE * SCALER_BLOCK_SIZE) == 0


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is stored in NF4 (double-quantized scales) and computed
    in the dtype it was quantized from (``compute_dtype``: bf16 for a bf16 model).

    ``qweight`` and ``compute_dtype`` are the names PEFT reads to place a new adapter next to a
    quantized base layer (device of ``qweight``; adapters created in ``compute_dtype``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        packed: torch.Tensor,
        scalers: torch.Tensor,
        factors: torch.Tensor,
        mean: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", packed)
        self.register_buffer("quantized_scalers", scalers)
        self.register_buffer("quantization_factor", factors)
        self.register_buffer("scaler_mean", mean)
        self.register_buffer("bias", bias)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.quantization_factor.dtype

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, device: torch.device | str) -> NF4Linear:
        """Quantize ``linear``'s weight on ``device`` (one layer's full-precision weight at a time)."""
        to_nf4 = require_torchao()
        weight = linear.weight.detach().to(device).contiguous()
        nf4 = to_nf4(weight, BLOCK_SIZE, SCALER_BLOCK_SIZE)
        bias = None if linear.bias is None else linear.bias.detach().to(device).clone()
        return cls(linear.in_features, linear.out_features, *nf4_components(nf4), bias=bias)

    def dequantize(self) -> torch.Tensor:
        """The ``[out_features, in_features]`` weight in ``compute_dtype``."""
        return nf4_dequantize(
            self.qweight,
            self.quantized_scalers,
            self.quantization_factor,
            self.scaler_mean,
            BLOCK_SIZE,
            SCALER_BLOCK_SIZE,
            self.out_features,
            self.in_features,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nf4_linear(
            x,
            self.qweight,
            self.quantized_scalers,
            self.quantization_factor,
            self.scaler_mean,
            BLOCK_SIZE,
            SCALER_BLOCK_SIZE,
            self.out_features,
            self.in_features,
        )
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4, compute={self.compute_dtype}"


class NF4LoraLinear(LoraLinear):
    """PEFT's LoRA linear around an :class:`NF4Linear` base (built through PEFT's custom-module
    mapping). The adapter stays in full precision; merging needs the full-precision base, which
    ``hone merge`` rebuilds (docs/quantization.md), so merging in place is refused."""

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    def merge(self, *args: Any, **kwargs: Any) -> None:
        raise ModelError(
            "adapter: a LoRA adapter on a 4-bit (model.quantize: nf4) base cannot be merged in place; "
            "run `hone merge RUN_DIR --output DIR`, which merges into the dequantized base in full precision"
        )


def register_nf4_lora(config: Any) -> None:
    """Have PEFT wrap every :class:`NF4Linear` target in :class:`NF4LoraLinear`."""
    config._register_custom_module({NF4Linear: NF4LoraLinear})


def has_nf4(model: nn.Module) -> bool:
    return any(isinstance(m, NF4Linear) for m in model.modules())


def quantizable_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear, str]]:
    """(parent, attribute, layer, full name) of every linear layer QLoRA quantizes: all but the
    output head (which stays in the model's dtype, as in QLoRA)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if isinstance(child, nn.Linear) and child is not head:
                found.append((parent, attr, child, f"{parent_name}.{attr}" if parent_name else attr))
    return found


def quantize_as_drawn(model: nn.Module) -> Callable[[nn.Module], nn.Module | None]:
    """The replacement :func:`hone.models.materialize.materialize` applies to each module of
    ``model`` (a meta skeleton) as soon as it is drawn: every linear layer QLoRA quantizes (all but
    the head, sizes that fit the blocks) becomes an :class:`NF4Linear` on the device it was drawn
    on, so only one layer's full-precision weight exists at a time. :func:`quantize_linears` (the
    plan's transform) then finds the base quantized and records it."""
    require_torchao()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def replace(module: nn.Module) -> nn.Module | None:
        if not isinstance(module, nn.Linear) or module is head or not can_quantize(module):
            return None
        return NF4Linear.from_linear(module, module.weight.device)

    return replace


def quantize_linears(model: nn.Module, device: torch.device | str) -> dict[str, Any]:
    """Replace the linear layers of ``model`` (except the head) by :class:`NF4Linear` on ``device``,
    one at a time: each full-precision weight is moved to ``device``, quantized there and dropped,
    so the device never holds more than one layer's full-precision weight. Layers already in NF4
    (a big preset quantized as it was drawn, :func:`quantize_as_drawn`) stay as they are. Returns
    the record (every NF4 layer of the model, whoever quantized it)."""
    require_torchao()
    kept = []
    for parent, attr, linear, name in quantizable_linears(model):
        if can_quantize(linear):
            setattr(parent, attr, NF4Linear.from_linear(linear, device))
        else:
            kept.append(name)
    quantized, full_bytes, nf4_bytes = 0, 0, 0
    for module in model.modules():
        if isinstance(module, NF4Linear):
            quantized += 1
            full_bytes += module.in_features * module.out_features * module.quantization_factor.element_size()
            nf4_bytes += sum(b.numel() * b.element_size() for n, b in module.named_buffers() if n != "bias")
    if quantized == 0:
        raise ModelError(
            f"model.quantize: nf4 found no linear layer it can quantize in {type(model).__name__}: a layer "
            f"needs a multiple of {BLOCK_SIZE * SCALER_BLOCK_SIZE} weights (blocks of {BLOCK_SIZE} "
            f"weights, {SCALER_BLOCK_SIZE} scales per factor); use model.quantize: none for this model"
        )
    return {
        "quantized_layers": quantized,
        "kept_layers": kept,
        "weights_mib": round(full_bytes / 2**20, 1),
        "nf4_mib": round(nf4_bytes / 2**20, 1),
    }


@torch.no_grad()
def nf4_roundtrip_(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every weight QLoRA quantizes by its NF4 round trip (quantized from ``dtype``,
    dequantized, back in the weight's own dtype): the base a QLoRA adapter was trained against,
    in full precision, for merging. Returns the number of layers changed."""
    to_nf4 = require_torchao()
    changed = 0
    for _, _, linear, _ in quantizable_linears(model):
        if not can_quantize(linear):
            continue
        nf4 = to_nf4(linear.weight.detach().to(dtype).contiguous(), BLOCK_SIZE, SCALER_BLOCK_SIZE)
        restored = nf4_dequantize(*nf4_components(nf4), BLOCK_SIZE, SCALER_BLOCK_SIZE, linear.out_features, linear.in_features)
        linear.weight.copy_(restored.to(linear.weight.dtype))
        changed += 1
    return changed
