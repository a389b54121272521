"""Optimizer and learning-rate schedule."""

import importlib.util
from typing import Literal

from pydantic import Field, model_validator

from hone.config.base import Section

#: Low-bit AdamW variants: torchao's optimizer class, and the bytes one moment of one weight takes
#: (its code plus its share of the block's float32 scale: 256 weights a block at 8 bits, 128 at 4).
LOW_BIT_ADAMW = {
    "adamw_8bit": ("AdamW8bit", 1 + 4 / 256),
    "adamw_4bit": ("AdamW4bit", 0.5 + 4 / 128),
}
LOW_BIT_INSTALL_HINT = "pip install 'hone[quant]' (or: pip install torchao)"


class OptimizerConfig(Section):
    """AdamW and the learning-rate schedule."""

    name: Literal["adamw", "adamw_8bit", "adamw_4bit"] = "adamw"
    """Optimizer. ``adamw``: torch's AdamW, moments in the weights' dtype (fused on CUDA where
    available). ``adamw_8bit`` / ``adamw_4bit``: torchao's ``AdamW8bit`` / ``AdamW4bit``, the two
    moments block-quantized to 8 or 4 bits (about 2 or 1 bytes a trainable weight instead of
    8 in float32; tensors under 4,096 values keep full-precision moments), CUDA or CPU, each
    parameter's update compiled with ``torch.compile``; needs ``pip install 'hone[quant]'``."""

    learning_rate: float = Field(2e-4, gt=0)
    """Peak learning rate."""

    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_epsilon: float = Field(1e-8, gt=0)

    fused: bool | Literal["auto"] = "auto"
    """Fused AdamW kernel; ``auto`` uses it on CUDA."""

    lr_scheduler: Literal["constant", "linear", "cosine"] = "cosine"
    """Shape of the learning rate after warm-up."""

    warmup_steps: int | None = Field(None, ge=0)
    """Linear warm-up length in optimizer steps. Set this or ``warmup_ratio``."""

    warmup_ratio: float | None = Field(None, ge=0, lt=1)
    """Linear warm-up length as a fraction of all optimizer steps."""

    cosine_min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the cosine and linear schedules, as a fraction of ``learning_rate``."""

    @model_validator(mode="after")
    def _low_bit_usable(self) -> "OptimizerConfig":
        if self.name not in LOW_BIT_ADAMW:
            return self
        if importlib.util.find_spec("torchao") is None:
            raise ValueError(
                f"optimizer.name: {self.name} needs the Python package 'torchao' (>= 0.18), which is not installed: "
                f"{LOW_BIT_INSTALL_HINT}, or set optimizer.name: adamw"
            )
        if self.fused is True:
            raise ValueError(
                f"optimizer.fused: true is torch's fused AdamW kernel; optimizer.name: {self.name} has its own "
                "(compiled) update: remove optimizer.fused or set optimizer.name: adamw"
            )
        return self

    def state_bytes(self, trainable_params: int, elem_bytes: int) -> int:
        """Bytes of the two AdamW moments of ``trainable_params`` weights of ``elem_bytes`` each."""
        if self.name in LOW_BIT_ADAMW:
            return round(2 * trainable_params * LOW_BIT_ADAMW[self.name][1])
        return 2 * trainable_params * elem_bytes

    @model_validator(mode="after")
    def _one_warmup(self) -> "OptimizerConfig":
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ValueError("set either optimizer.warmup_steps or optimizer.warmup_ratio, not both")
        return self

    def warmup_for(self, total_steps: int) -> int:
        """Warm-up steps for a run of ``total_steps`` optimizer steps."""
        if self.warmup_steps is not None:
            return min(self.warmup_steps, total_steps)
        if self.warmup_ratio is not None:
            return int(self.warmup_ratio * total_steps)
        return 0
