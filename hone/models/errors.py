"""Errors about models, adapters and run directories."""

from hone.errors import HoneError


class ModelError(HoneError):
    """A model directory, preset, adapter setting or run directory that hone cannot use."""
