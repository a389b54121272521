"""The long-lived process that runs kernel checks under Triton's interpreter (tests/interpreted.py).

Started with ``TRITON_INTERPRET=1`` in its environment, so triton reads it at its first import.
Reads one JSON request per line on stdin, ``{"args": [...]}`` as ``python`` would take them (a
script path and its arguments, or ``-c`` and a program), runs it as ``__main__`` with its own
``sys.argv``, and answers with one line: :data:`REPLY` and ``{"stdout", "error"}`` (``error``
empty when the check ran to its end). Anything else on stdout (a C library's print) is not a
reply, so the caller skips it.
"""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback

REPLY = "\x00hone-interpreted-reply "


def run_check(args: list[str]) -> dict:
    """One check, as ``python *args`` would run it; its stdout and any error."""
    out = io.StringIO()
    error = ""
    sys.argv = ["-c", *args[2:]] if args[0] == "-c" else list(args)
    if args[0] != "-c":
        folder = os.path.dirname(os.path.abspath(args[0]))
        if folder not in sys.path:
            sys.path.insert(0, folder)  # as python puts a script's folder first
    try:
        with contextlib.redirect_stdout(out):
            if args[0] == "-c":
                exec(compile(args[1], "<check>", "exec"), {"__name__": "__main__"})
            else:
                runpy.run_path(args[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            error = f"the check exited with {stop.code!r}"
    except BaseException:  # reported to the test, which fails with it
        error = traceback.format_exc()
    return {"stdout": out.getvalue(), "error": error}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("interpreted_worker.py needs TRITON_INTERPRET=1 in its environment")
    reply_to = sys.stdout
    for line in sys.stdin:
        result = run_check(json.loads(line)["args"])
        reply_to.write(REPLY + json.dumps(result) + "\n")
        reply_to.flush()


if __name__ == "__main__":
    main()
