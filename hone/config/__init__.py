"""Typed configuration: YAML in, a validated, frozen :class:`HoneConfig` out."""

from hone.config.errors import ConfigError, ConfigIssue
from hone.config.loader import apply_overrides, load_config, parse_config
from hone.config.root import HoneConfig

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "HoneConfig",
    "apply_overrides",
    "load_config",
    "parse_config",
]
