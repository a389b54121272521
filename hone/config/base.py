"""Shared base class for every config section.

Every section forbids unknown keys (a typo must never be silently ignored) and validates
assignments, so a config stays valid after construction.
"""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base for config sections: strict about keys, frozen after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    def explicitly_set(self, name: str) -> bool:
        """Whether the user wrote ``name`` (as opposed to it holding its default)."""
        return name in self.model_fields_set
