"""How much of a profiled step's communication ran beside compute, from a chrome trace.

    python scripts/comm_overlap.py trace.json [trace.rank1.json ...]
    python scripts/profile_step.py ... --overlap     # the same section in the profile's markdown

A collective only hides behind compute when its kernel runs while a compute kernel does. The
trace's device kernels are split into NCCL kernels and the rest; the NCCL kernels' time (their
intervals merged) is intersected with the union of the compute kernels' intervals. 0% means
every exchange ran alone: the compute stream waited for each one as soon as it was issued
(expert parallelism's chunked exchanges in session 27, benchmarks/2026-11-29-h200x2-expert-parallel.md).
"""

import json
import sys
from pathlib import Path

Interval = tuple[float, float]


def merged(intervals: list[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Length of the intersection of two unions of disjoint, sorted intervals."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def summarize(trace: Path) -> str:
    """One markdown line: NCCL kernel time, the part of it beside compute, the kernels' span."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return f"{trace}: no device kernels in the trace"
    comm = merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()])
    compute = merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()])
    comm_ms = sum(b - a for a, b in comm) / 1e3
    beside_ms = overlap(comm, compute) / 1e3
    span_ms = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / 1e3
    share = f"{100 * beside_ms / comm_ms:.0f}%" if comm_ms else "-"
    return (
        f"kernels' span {span_ms:.1f} ms, compute {sum(b - a for a, b in compute) / 1e3:.1f} ms, "
        f"NCCL {comm_ms:.1f} ms, of which beside compute {beside_ms:.1f} ms ({share})"
    )


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(f"{path}: {summarize(Path(path))}")
