"""Byte units and how hone quotes and reads them: one definition for every module that counts memory."""

import re

GIB = 2**30
MIB = 2**20

_UNITS = {
    "": GIB,  # a bare number is GiB
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_bytes(text: str, name: str = "") -> int:
    """Bytes in ``text``: ``80GiB``, ``24GB``, ``141 GiB``, ``81559MiB``, or a bare number of GiB.
    A ``ValueError`` otherwise, naming ``name`` (the flag; a config key is added by the loader)."""
    prefix = f"{name}: " if name else ""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{prefix}'{text}' is not a memory size; write a number with a unit, e.g. 80GiB, 24GB, "
            "141GiB or 81559MiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; a bare number is GiB)"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{prefix}'{text}' is not a positive memory size")
    return size


def gib(n: float) -> str:
    """``n`` bytes as ``12.3 GiB``: one decimal and the unit, as decisions and their reasons quote sizes."""
    return f"{n / GIB:.1f} GiB"


def gib_cell(n: float) -> str:
    """``n`` bytes as ``12.34``: two decimals and no unit, for the cells of a table whose header names it."""
    return f"{n / GIB:.2f}"
