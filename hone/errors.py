"""User-facing errors: the CLI prints them as one paragraph and exits with code 2.

Anything else that escapes is a bug in hone and keeps its traceback (``hone train`` turns one
that escapes before the first optimizer step into a paragraph too: see
:mod:`hone.train.start_guard`).
"""


class HoneError(Exception):
    """A problem with the user's input (config, data, model directory), not with hone."""

    exit_code = 2


class WriteError(HoneError, OSError):
    """hone could not write a file or directory (disk full, read-only, no permission).

    Also an :class:`OSError` (with the original ``errno``), so code that already handles
    ``OSError`` keeps working; its message names the path and says what was kept.
    """

    def __init__(self, message: str, errno: int | None = None) -> None:
        OSError.__init__(self, errno, message)
        self.message = message

    def __str__(self) -> str:
        return self.message
