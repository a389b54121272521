"""User-facing errors: the CLI prints them as one paragraph and exits with code 2.

Anything else that escapes is a bug in hone and keeps its traceback.
"""


class HoneError(Exception):
    """A problem with the user's input (config, data, model directory), not with hone."""

    exit_code = 2
