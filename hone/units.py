"""Byte units and how hone quotes them: one definition for every module that counts memory."""

GIB = 2**30
MIB = 2**20


def gib(n: float) -> str:
    """``n`` bytes as ``12.3 GiB``: one decimal and the unit, as decisions and their reasons quote sizes."""
    return f"{n / GIB:.1f} GiB"


def gib_cell(n: float) -> str:
    """``n`` bytes as ``12.34``: two decimals and no unit, for the cells of a table whose header names it."""
    return f"{n / GIB:.2f}"
