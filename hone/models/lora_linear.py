"""PEFT's LoRA linear layer with hone's fused forward (:func:`hone.kernels.lora_linear.lora_linear`).

:class:`HoneLoraLinear` is PEFT's ``lora.Linear`` in every respect but its ``forward``: the same
``lora_A`` / ``lora_B`` / ``base_layer`` submodules, state dict keys, ``adapter_config.json``,
merging and adapter switching (it is a subclass, so PEFT's own checks still see a LoRA layer).
Its forward computes ``base(x) + lora_B(lora_A(dropout(x))) * s`` in one autograd function
whose matmuls accumulate the LoRA product into the base's output and input gradient, with the
scaling on the rank-wide tensors: fewer passes over ``[tokens, features]`` tensors, the same
numbers up to the dtype's rounding (the kernel's docstring has the arithmetic and the measurement).

:func:`use_fused_lora` puts one in place of each PEFT ``lora.Linear`` *instance* of a loaded
model, sharing the original's submodules and parameters (the same ``_modules`` /
``_parameters`` dicts), so nothing is copied and every name stays; PEFT's classes are not
touched. The forward takes the fused path where it covers the layer's state and calls PEFT's
own forward otherwise: adapters disabled or merged, several active adapters or a mixed-adapter
batch, a LoRA variant (DoRA and the like), a LoRA bias, a trainable base, a base that is
neither a plain ``nn.Linear`` nor a frozen float8 one (QLoRA's 4-bit base), or operands in
different dtypes outside autocast (PEFT then computes LoRA in float32 and the fused path would
not).

A frozen float8 base (:class:`hone.transforms.fp8.Fp8FrozenLinear`, swapped in after this
layer is built) is recognised by its ``fp8_weight``: the :class:`FrozenFp8Weight` its own
forward multiplies by.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from hone.kernels.fp8_linear import FrozenFp8Weight
from hone.kernels.lora_linear import lora_linear

__all__ = ["HoneLoraLinear", "use_fused_lora"]


class HoneLoraLinear(LoraLinear):
    """PEFT's ``lora.Linear`` whose forward runs hone's fused LoRA linear (module docstring)."""

    @classmethod
    def replacing(cls, layer: LoraLinear) -> HoneLoraLinear:
        """A new instance standing for ``layer``: its attributes, submodules and parameters shared."""
        fused = cls.__new__(cls)
        fused.__dict__.update(layer.__dict__)
        return fused

    def _fused_base(self) -> tuple[torch.Tensor | FrozenFp8Weight, torch.Tensor | None] | None:
        """The frozen base as the kernel takes it (weight or float8 weight, and bias), or None."""
        base = self.get_base_layer()
        if not isinstance(base, nn.Linear) or base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
            return None
        if type(base) is nn.Linear:
            return base.weight, base.bias
        fp8_weight = getattr(base, "fp8_weight", None)
        return (fp8_weight, base.bias) if isinstance(fp8_weight, FrozenFp8Weight) else None

    def _fused_adapter(self) -> str | None:
        """The one active adapter the fused forward computes, or None where PEFT's forward must run."""
        if self.disable_adapters or self.merged:
            return None
        active = [name for name in self.active_adapters if name in self.lora_A]
        if len(active) != 1:
            return None
        name = active[0]
        if name in self.lora_variant or self.lora_B[name].bias is not None:
            return None
        return name

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        name = None if args or kwargs else self._fused_adapter()
        base = None if name is None else self._fused_base()
        if name is None or base is None:
            return super().forward(x, *args, **kwargs)
        weight, bias = base
        lora_a, lora_b = self.lora_A[name].weight, self.lora_B[name].weight
        if not torch.is_autocast_enabled(x.device.type):
            if not x.dtype == lora_a.dtype == lora_b.dtype == self.get_base_layer().weight.dtype:
                return super().forward(x, *args, **kwargs)
        dropout = self.lora_dropout[name]
        x_lora = None if isinstance(dropout, nn.Identity) or not dropout.training else dropout(x)
        return lora_linear(x, weight, bias, lora_a, lora_b, float(self.scaling[name]), x_lora=x_lora)


def use_fused_lora(model: nn.Module) -> int:
    """Put a :class:`HoneLoraLinear` in place of every PEFT ``lora.Linear`` instance of ``model``
    (QLoRA's 4-bit LoRA layer and other subclasses stay); returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is LoraLinear:
                setattr(parent, child_name, HoneLoraLinear.replacing(child))
                replaced += 1
    return replaced
