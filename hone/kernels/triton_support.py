"""Triton, where it is installed, and whether a kernel can run on a device.

Triton is optional: CUDA wheels of torch bring it, CPU wheels do not. Every Triton kernel module
imports ``triton`` / ``tl`` from here (``None`` without triton, so the modules import anyway and
their ops fall back or refuse) and asks :func:`triton_available` before launching.
"""

from __future__ import annotations

import os

import torch

try:  # optional: CUDA wheels of torch bring triton, CPU wheels do not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = ["tl", "triton", "triton_available"]


def triton_available(device: torch.device | str) -> bool:
    """Whether a Triton kernel can run on ``device``: CUDA with triton installed, or any device
    under the interpreter (``TRITON_INTERPRET=1``, set before triton is imported)."""
    if triton is None:
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
