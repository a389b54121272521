"""Running kernel checks under Triton's interpreter from a test.

``TRITON_INTERPRET=1`` must be set before triton is imported, so a test that checks a Triton
kernel on the CPU runs its checks in a fresh Python process with it set (this checkout first on
the import path) and reads back what the checks measured: the JSON after the last line's
``RESULT `` marker. A check that crashes fails the test with the end of its stderr.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "RESULT "


def run_interpreted(args: list[str], timeout_s: int = 600) -> dict:
    """``python *args`` with ``TRITON_INTERPRET=1``; the JSON of its ``RESULT `` line."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in reversed(proc.stdout.splitlines()) if line.startswith(MARKER))
    return json.loads(line[len(MARKER) :])
