"""Run every (condition, replicate) of a spec in a fresh process and collect the rows.

A failing row (exception, out of memory, timeout) is recorded as such and the rest go on.
"""

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hone.bench.spec import BenchSpec, Condition
from hone.errors import HoneError

_TAIL = 1500
_WHOLE_LOG = "_whole_log"  # a failed row's whole stderr, until run_bench writes it out


#: The start of a raised exception's line in a traceback (``ValueError: ...``, ``torch._inductor.exc.InductorError: ...``).
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")
#: What torch prints after every compile error: it names no cause.
_TORCH_HINTS = ("Set TORCHDYNAMO_VERBOSE", "For even more developer context")
#: What torchrun puts before each line a rank writes to stderr (``[rank0]: ValueError: ...``).
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
#: torchrun's own exception when a rank fails: the rank's exception above it is the cause.
_LAUNCHER_ERROR = "ChildFailedError"
#: How much of a failed rank's traceback a multi-process row keeps (torchrun's summary follows it).
_TRACEBACK = 4000


def classify_failure(returncode: int, stderr: str) -> tuple[str, str]:
    """(status, one-line reason) from a failed worker's exit code and stderr: the last raised
    exception with its continuation lines (a config error lists its problems below its first
    line), without the hint torch appends to every compile error."""
    if "OutOfMemoryError" in stderr or "CUDA out of memory" in stderr:
        return "oom", "out of memory"
    lines = [_RANK_PREFIX.sub("", line.strip()) for line in stderr.strip().splitlines()]
    lines = [line.strip() for line in lines if line.strip() and not line.strip().startswith(_TORCH_HINTS)]
    raised = [i for i, line in enumerate(lines) if _EXCEPTION_LINE.match(line) and _LAUNCHER_ERROR not in line]
    if raised:
        ends = [i for i, line in enumerate(lines) if i > raised[-1] and line.startswith(("Traceback", "File ", "["))]
        reason = " ".join(lines[raised[-1] : ends[0] if ends else None])
    else:
        reason = lines[-1] if lines else f"exit code {returncode}"
    return "error", reason[:300]


class BenchNprocError(HoneError):
    """A condition asks for more processes than this machine has GPUs."""


def check_nproc(spec: BenchSpec, gpus: int | None = None) -> None:
    """Refuse, before anything runs, a condition whose ``nproc`` exceeds the visible GPUs."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    for condition in spec.conditions:
        if condition.nproc > 1 and condition.nproc > gpus:
            raise BenchNprocError(
                f"condition '{condition.name}': nproc: {condition.nproc} needs {condition.nproc} GPUs, but "
                f"{gpus} {'is' if gpus == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES); use nproc <= {gpus}"
            )


def worker_command(spec_file: Path, condition: Condition, replicate: int, result_file: Path) -> list[str]:
    """One process, or ``torchrun --standalone --nproc-per-node N`` of the same worker."""
    args = ["-m", "hone.bench.worker", str(spec_file), condition.name, str(replicate), str(result_file)]
    if condition.nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={condition.nproc}", *args]


def merge_ranks(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from every rank's: the slowest rank's step times (the step waits for it), total
    tok/s summed over ranks and per GPU, the fullest rank's peak memory; what the plan decided and
    compiled from the rank that writes the run's record (rank 0), whichever rank was slowest."""
    slowest = max(rows, key=lambda r: r["median_ms"])
    merged = dict(slowest)
    for key in ("decided", "compile"):
        recorded = next((r[key] for r in rows if r.get(key) is not None), None)
        if recorded is not None:
            merged[key] = recorded
    merged["nproc"] = len(rows)
    for key in ("tokens_per_s", "trained_tokens_per_s"):
        merged[key] = round(sum(r[key] for r in rows), 1)
        merged[f"{key}_per_gpu"] = round(merged[key] / len(rows), 1)
    for key in ("peak_alloc_gib", "peak_reserved_gib", "peak_host_gib", "alloc_retries"):
        values = [r[key] for r in rows if r.get(key) is not None]
        merged[key] = max(values) if values else None
    merged["peak_alloc_gib_per_rank"] = [r.get("peak_alloc_gib") for r in rows]
    return merged


def add_scaling(rows: list[dict[str, Any]]) -> None:
    """``scaling``: a multi-process row's total tok/s over the one-process hone row with the same
    overrides (else the spec's first one-process hone row); ``scaling_per_gpu``: the same per GPU
    (what expert parallelism's targets compare); ``peak_vs_one``: its fullest rank's peak over
    that row's."""
    singles = [r for r in rows if r.get("status") == "ok" and r.get("kind") == "hone" and r.get("nproc", 1) == 1]
    for row in rows:
        if row.get("status") != "ok" or row.get("nproc", 1) == 1 or not singles:
            continue
        same = [r for r in singles if r.get("set") == row.get("set_without_nproc")]
        base = (same or singles)[0]
        row["scaling"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        row["scaling_per_gpu"] = round(row["scaling"] / row["nproc"], 3)
        row["scaling_vs"] = base["condition"]
        if row.get("peak_alloc_gib") and base.get("peak_alloc_gib"):
            row["peak_vs_one"] = round(row["peak_alloc_gib"] / base["peak_alloc_gib"], 3)


def one_gpu(visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a one-process row: the first visible GPU only. On a host of
    several GPUs a peer trainer would otherwise spread itself (transformers' ``Trainer`` wraps the
    model in ``nn.DataParallel``, which TRL's DPOTrainer refuses), and every one-GPU row should
    measure the same single card."""
    if visible is None:
        return "0"
    return visible.split(",")[0].strip()


def run_one(spec_file: Path, spec: BenchSpec, condition: str, replicate: int, workdir: Path) -> dict[str, Any]:
    result_file = workdir / f"result-{abs(hash((condition, replicate)))}.json"
    chosen = next(c for c in spec.conditions if c.name == condition)
    cmd = worker_command(spec_file, chosen, replicate, result_file)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if chosen.nproc == 1:
        env["CUDA_VISIBLE_DEVICES"] = one_gpu(env.get("CUDA_VISIBLE_DEVICES"))
    started = time.perf_counter()
    row: dict[str, Any] = {"spec": spec.name, "condition": condition, "replicate": replicate}
    row["kind"] = chosen.reference or "hone"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=spec.timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:
        row.update(status="timeout", error=f"no result after {spec.timeout_s:.0f} s")
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        row["log_tail"], row[_WHOLE_LOG] = stderr[-_TAIL:], stderr
        row["wall_s"] = round(time.perf_counter() - started, 1)
        return row
    row["wall_s"] = round(time.perf_counter() - started, 1)
    if chosen.nproc > 1:
        rank_files = [result_file.with_name(f"{result_file.stem}.rank{r}.json") for r in range(chosen.nproc)]
        if proc.returncode == 0 and all(f.exists() for f in rank_files):
            row.update(merge_ranks([json.loads(f.read_text()) for f in rank_files]), status="ok")
            row["set"], row["set_without_nproc"] = chosen.set, chosen.set
            return row
    elif proc.returncode == 0 and result_file.exists():
        row.update(json.loads(result_file.read_text()), status="ok", nproc=1, set=chosen.set)
        return row
    status, reason = classify_failure(proc.returncode, proc.stderr)
    row.update(status=status, error=reason, log_tail=failure_log(proc.stderr))
    row[_WHOLE_LOG] = proc.stderr
    return row


def keep_whole_log(row: dict[str, Any], out_dir: Path) -> None:
    """A failed row's whole stderr written to ``out_dir/logs/`` (its path in ``log_file``): the
    row keeps only the head of the first traceback and the end, and a compiler's error is often
    in between (Inductor's, under a torchrun rank's prefix)."""
    whole = row.pop(_WHOLE_LOG, None)
    if not whole:
        return
    slug = re.sub(r"[^A-Za-z0-9]+", "-", row["condition"]).strip("-").lower()
    at_length = f"-{row['sequence_len']}" if "sequence_len" in row else ""  # a length probe (hone.bench.longest)
    path = out_dir / "logs" / f"{slug}{at_length}-{row['replicate']}.log"
    path.parent.mkdir(exist_ok=True)
    partial = path.with_suffix(".log.partial")
    partial.write_text(whole, encoding="utf-8")
    partial.replace(path)
    row["log_file"] = str(path)


def failure_log(stderr: str) -> str:
    """The end of a failed worker's stderr; where torchrun reports a failed rank, the rank's own
    traceback before it (torchrun's summary alone names no cause)."""
    launcher = stderr.find(_LAUNCHER_ERROR)
    if launcher < 0:
        return stderr[-_TAIL:]
    first = stderr.find("Traceback (most recent call last)")
    cause = stderr[first : first + _TRACEBACK] if 0 <= first < launcher else ""
    return cause + "\n...\n" + stderr[-_TAIL:]


def environment() -> dict[str, Any]:
    """Versions that a reader of the table needs to reproduce it."""
    import peft
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    from importlib.metadata import PackageNotFoundError, version

    try:  # the peer of reference: trl-dpo rows
        env["trl"] = version("trl")
    except PackageNotFoundError:
        pass
    return env


def record_row(
    row: dict[str, Any],
    env: dict[str, Any],
    rows: list[dict[str, Any]],
    results: Path,
    on_row: Callable[[dict[str, Any]], None] | None,
) -> None:
    """Keep ``row`` (with the environment) and append it to ``results`` at once: a bench cut
    short keeps every row that finished. A failed row's whole log goes beside ``results``."""
    keep_whole_log(row, results.parent)
    row["env"] = env
    rows.append(row)
    with results.open("a") as f:
        f.write(json.dumps(row) + "\n")
    if on_row is not None:
        on_row(row)


def run_bench(spec: BenchSpec, out_dir: Path, on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run the whole spec; rows are appended to ``out_dir/results.jsonl`` as they finish."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    check_nproc(spec)
    env = environment()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hone-bench-") as tmp:
        workdir = Path(tmp)
        spec_file = workdir / "spec.json"
        spec_file.write_text(spec.model_dump_json(exclude_unset=True))  # re-validated as written
        for condition in spec.conditions:
            for replicate in range(spec.replicates):
                record_row(run_one(spec_file, spec, condition.name, replicate, workdir), env, rows, results, on_row)
    add_scaling(rows)
    return rows
