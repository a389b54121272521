"""Trading compute for memory."""

from hone.config.base import Section


class MemoryConfig(Section):
    """Trading compute for memory."""

    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of storing them."""
