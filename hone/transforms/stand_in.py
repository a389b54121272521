"""A module that takes the place of another without changing the model's names.

Why: the tiled MLP and tiled decoder layers replace a module *instance* with one that computes
it differently (in shards, in chunks), and everything keyed by parameter names (state dicts,
PEFT adapter files, checkpoints, FSDP) must see exactly the names of the original. Sharing the
original's ``_parameters``/``_buffers``/``_modules`` dicts does that: the stand-in's children
are the original's children, and the original itself is kept unregistered as ``inner``, to be
called with its own forward and hooks. transformers' classes are not touched.
"""

from typing import Any

from torch import nn


class StandIn(nn.Module):
    """Base of a module that stands in for ``inner`` (see the module docstring); subclasses
    give the forward. ``count`` is validated here because every stand-in splits its work in
    ``count`` pieces (2 or more) and refuses anything else in the same words."""

    def __init__(self, inner: nn.Module, count: int, what: str) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 2:
            raise ValueError(f"{what} must be an integer >= 2, got {count!r}")
        super().__init__()
        self.__dict__["inner"] = inner  # not a child: its children are this module's own
        self._parameters = inner._parameters
        self._buffers = inner._buffers
        self._non_persistent_buffers_set = inner._non_persistent_buffers_set
        self._modules = inner._modules
        self.training = inner.training

    def train(self, mode: bool = True) -> "StandIn":
        super().train(mode)
        self.inner.training = mode
        return self

    def __getattr__(self, name: str) -> Any:
        """Attributes of the original module (``config``, sizes, ``layer_idx``) read through the stand-in."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("inner")
            if inner is None:
                raise
            return getattr(inner, name)
