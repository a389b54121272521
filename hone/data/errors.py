"""The one exception type of the data pipeline.

Everything that is wrong with the user's data or data options (a missing file, a malformed
line, a row without a field, an unknown chat role, a template that trains nothing) is a
:class:`DataError`: the CLI prints its message and exits 2, with no traceback. Messages name
the file, the 1-based row (or line) and the config key, the bad value and what is allowed.
"""

from pathlib import Path

from hone.errors import HoneError


class DataError(HoneError):
    """A problem with the training data or the options that say how to read it."""


def at_row(path: Path | str, row: int, message: str) -> str:
    """``file.jsonl row 3: message`` (``row`` is 1-based)."""
    return f"{path} row {row}: {message}"
