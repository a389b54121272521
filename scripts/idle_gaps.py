"""Where the GPU waits for the host: idle gaps of a ``torch.profiler`` chrome trace, by cause.

    python scripts/idle_gaps.py trace.json [--min-us 20] [--top 20]

A gap is a stretch with no kernel, copy or memset running on any stream. Each gap is put down
to what the host was doing at its middle: the innermost torch ops, the loop's phase (hone's
``record_function`` ranges) and, in a trace recorded with ``with_stack=True``, the innermost
Python frames of hone, transformers or peft (stacks slow the host down: they show where, not
how much).
Used by scripts/profile_step.py (``--gaps``); works on any trace with stacks.
"""

import argparse
import bisect
import json
from collections import defaultdict
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
OURS = ("hone/", "transformers/", "peft/", "torch/")


def device_busy(events: list[dict]) -> list[tuple[float, float]]:
    """Merged [start, end] intervals (µs) during which the device ran anything."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def idle_gaps(busy: list[tuple[float, float]], min_us: float) -> list[tuple[float, float]]:
    return [(a_end, b_start) for (_, a_end), (b_start, _) in zip(busy, busy[1:]) if b_start - a_end >= min_us]


def frame_label(name: str) -> str:
    """``.../site-packages/transformers/masking_utils.py(870): f`` -> ``transformers/masking_utils.py(870): f``."""
    for marker in OURS:
        at = name.rfind(marker)
        if at >= 0:
            return name[at:]
    return name


def host_stacks(events: list[dict]) -> tuple[list[float], list[dict]]:
    frames = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op", "user_annotation")),
        key=lambda e: e["ts"],
    )
    return [f["ts"] for f in frames], frames


def cause_at(t: float, starts: list[float], frames: list[dict], depth: int) -> str:
    """The innermost ``depth`` frames of hone/transformers/peft (else torch) on the host stack at time ``t``."""
    i = bisect.bisect_right(starts, t)
    live = [f for f in frames[max(0, i - 4000) : i] if f["ts"] + f.get("dur", 0) >= t]
    live.sort(key=lambda f: f.get("dur", 0))  # innermost first (shortest enclosing span)
    named = [frame_label(f["name"]) for f in live if f.get("cat") == "python_function"]
    mine = [n for n in named if n.startswith(("hone/", "transformers/", "peft/"))]
    ops = [f["name"] for f in live if f.get("cat") == "cpu_op"][:2]
    phase = [f["name"] for f in live if f.get("cat") == "user_annotation" and f["name"].startswith("hone:")][:1]
    chain = (mine or named)[:depth]
    return " <- ".join(ops + chain + phase) or "(no host frame: host idle or outside the trace)"


def summarize(trace: Path, min_us: float = 20.0, top: int = 20, depth: int = 3) -> str:
    events = json.loads(trace.read_text())["traceEvents"]
    busy = device_busy(events)
    gaps = idle_gaps(busy, min_us)
    starts, frames = host_stacks(events)
    by_cause: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for a, b in gaps:
        cause = cause_at((a + b) / 2, starts, frames, depth)
        by_cause[cause][0] += b - a
        by_cause[cause][1] += 1
    span = busy[-1][1] - busy[0][0] if busy else 0.0
    idle = sum(b - a for a, b in gaps)
    lines = [
        f"device span {span / 1000:.1f} ms, busy {sum(b - a for a, b in busy) / 1000:.1f} ms, "
        f"idle in gaps >= {min_us:g} µs: {idle / 1000:.1f} ms in {len(gaps)} gaps",
        "",
        "| host was in | idle ms | gaps |",
        "|---|---|---|",
    ]
    for cause, (t, n) in sorted(by_cause.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| `{cause[:220]}` | {t / 1000:.2f} | {n} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace", type=Path)
    p.add_argument("--min-us", type=float, default=20.0)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--depth", type=int, default=3)
    args = p.parse_args()
    print(summarize(args.trace, args.min_us, args.top, args.depth))


if __name__ == "__main__":
    main()
