"""Optimizer and learning-rate schedule."""

from typing import Literal

from pydantic import Field, model_validator

from hone.config.base import Section


class OptimizerConfig(Section):
    """AdamW and the learning-rate schedule."""

    name: Literal["adamw"] = "adamw"
    """Optimizer; AdamW (fused on CUDA where available)."""

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
