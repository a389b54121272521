"""What each attention backend can do, declared once, without importing torch.

The config reads this table to expose capabilities as computed properties and to refuse
impossible combinations before anything is loaded (``model.attn_implementation`` with
``data.sample_packing``, float32, a missing package). The loader reads it again (through
``cfg.model.attention``) to refuse a backend that needs CUDA on a machine without it. It lives
in the config package, the bottom layer, so the config never imports ``hone.models``.
"""

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionBackend:
    """One value of ``model.attn_implementation`` and its capabilities."""

    name: str
    isolates_packed_documents: bool
    """Packed documents never attend to each other (by mask, BlockMask or varlen boundaries)."""
    needs_cuda: bool
    """Runs only on a CUDA GPU."""
    trains_on_cpu: bool
    """Has a backward pass on the CPU (flex_attention's CPU path is forward-only)."""
    package: str | None
    """Extra Python package (import name) the backend needs, if any."""
    works_under_compile: bool
    """Traces under ``torch.compile`` without graph breaks in the attention call."""
    sliding_window: bool
    """Honours a model's sliding-window layers (Mistral, Gemma)."""
    supports_float32: bool
    """Computes in float32 (flash kernels are bf16/fp16 only)."""
    skips_masked_blocks: bool
    """Spends no compute on the masked-out blocks between packed documents."""

    @property
    def installed(self) -> bool:
        """Whether the extra package is importable here (looked up, not imported)."""
        return self.package is None or importlib.util.find_spec(self.package) is not None


BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend("eager", True, False, True, None, True, True, True, False),
        AttentionBackend("sdpa", True, False, True, None, True, True, True, False),
        AttentionBackend("flex_attention", True, False, False, None, True, True, True, True),
        AttentionBackend("flash_attention_2", True, True, False, "flash_attn", True, True, False, True),
        AttentionBackend("flash_attention_3", True, True, False, "flash_attn_interface", True, True, False, True),
    )
}


def backend(name: str) -> AttentionBackend:
    return BACKENDS[name]


def installed_backends() -> list[str]:
    """Backends whose packages are present on this machine (tests loop over these)."""
    return [name for name, b in BACKENDS.items() if b.installed]
