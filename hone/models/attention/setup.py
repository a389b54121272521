"""Checks a chosen attention backend against the machine, before a model is built.

The config already refused what is impossible anywhere (a missing package, float32 flash);
what depends on the device (CUDA-only kernels, flex_attention's forward-only CPU path) can
only be checked here, once the device is known.
"""

import torch

from hone.config.model import ModelConfig
from hone.models.errors import ModelError


def check_attention(model_cfg: ModelConfig, device: torch.device, training: bool = True) -> None:
    """Raise :class:`ModelError` if ``model.attn_implementation`` cannot run (or train) on ``device``."""
    backend = model_cfg.attention
    name = model_cfg.attn_implementation
    if backend.needs_cuda and device.type != "cuda":
        raise ModelError(
            f"model.attn_implementation: '{name}' runs on CUDA GPUs only, but the device is {device.type}: "
            "use sdpa (or flex_attention on a GPU)"
        )
    if training and not backend.trains_on_cpu and device.type == "cpu":
        raise ModelError(
            f"model.attn_implementation: '{name}' has no backward pass on the CPU (forward only): "
            "train with sdpa on the CPU, or train on a GPU"
        )
