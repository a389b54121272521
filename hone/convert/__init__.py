"""Translate other tools' configs into hone's (``hone convert``)."""

from hone.convert.axolotl import Conversion, Untranslated, convert_axolotl, render_conversion

__all__ = ["Conversion", "Untranslated", "convert_axolotl", "render_conversion"]
