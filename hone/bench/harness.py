"""Run every (condition, replicate) of a spec in a fresh process and collect the rows.

A failing row (exception, out of memory, timeout) is recorded as such and the rest go on.
"""

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hone.bench.spec import BenchSpec

_TAIL = 1500


def classify_failure(returncode: int, stderr: str) -> tuple[str, str]:
    """(status, one-line reason) from a failed worker's exit code and stderr."""
    if "OutOfMemoryError" in stderr or "CUDA out of memory" in stderr:
        return "oom", "out of memory"
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else f"exit code {returncode}"
    return "error", last[:300]


def run_one(spec_file: Path, spec: BenchSpec, condition: str, replicate: int, workdir: Path) -> dict[str, Any]:
    result_file = workdir / f"result-{abs(hash((condition, replicate)))}.json"
    cmd = [sys.executable, "-m", "hone.bench.worker", str(spec_file), condition, str(replicate), str(result_file)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    row: dict[str, Any] = {"spec": spec.name, "condition": condition, "replicate": replicate}
    kind = next(c for c in spec.conditions if c.name == condition).reference or "hone"
    row["kind"] = kind
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=spec.timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:
        row.update(status="timeout", error=f"no result after {spec.timeout_s:.0f} s")
        row["log_tail"] = (exc.stderr or b"")[-_TAIL:].decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")[-_TAIL:]
        row["wall_s"] = round(time.perf_counter() - started, 1)
        return row
    row["wall_s"] = round(time.perf_counter() - started, 1)
    if proc.returncode == 0 and result_file.exists():
        row.update(json.loads(result_file.read_text()), status="ok")
    else:
        status, reason = classify_failure(proc.returncode, proc.stderr)
        row.update(status=status, error=reason, log_tail=proc.stderr[-_TAIL:])
    return row


def environment() -> dict[str, Any]:
    """Versions that a reader of the table needs to reproduce it."""
    import peft
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


def run_bench(spec: BenchSpec, out_dir: Path, on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run the whole spec; rows are appended to ``out_dir/results.jsonl`` as they finish."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    env = environment()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hone-bench-") as tmp:
        workdir = Path(tmp)
        spec_file = workdir / "spec.json"
        spec_file.write_text(spec.model_dump_json(exclude_unset=True))  # re-validated as written
        for condition in spec.conditions:
            for replicate in range(spec.replicates):
                row = run_one(spec_file, spec, condition.name, replicate, workdir)
                row["env"] = env
                rows.append(row)
                with results.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                if on_row is not None:
                    on_row(row)
    return rows
