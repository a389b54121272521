"""What holds the GPU's memory at the peak of one training step, by the line that allocated it.

    python scripts/memory_at_peak.py --preset qwen3-8b --pairs 512,768 --out peak.md
    python scripts/memory_at_peak.py --preset qwen3-8b --seq 4096 --set memory.activation_checkpointing=none
    torchrun --nproc-per-node 2 scripts/memory_at_peak.py --preset qwen3-30b-a3b ... --set distributed.expert_parallel=2

Builds the run as scripts/profile_step.py does (the same arguments: random tokens or pairs, the
path of ``hone train``), trains ``--warmup`` steps, then records the caching allocator's history
(``torch.cuda.memory._record_memory_history``) over one more step. Replaying that history finds
the moment the step's allocated bytes peak and which of the step's own allocations are alive
then; they are grouped by the innermost frame of hone, transformers, peft or Inductor's
generated code (with the source line, so a compiled layer's saved buffers show as the
``empty_strided_cuda`` lines that made them). What was allocated before the step (weights,
optimizer state, caches) is one line: "held from before the step". Under torchrun every rank
writes its own report (``OUT`` with ``.rankR`` before the suffix).

A diagnostic, not a measurement: the bench's peak (``hone bench``) counts every step. With CUDA
graphs a replayed step allocates nothing (its tensors live in the graphs' pool, allocated when
they were recorded), so the peak is a recording step's: ``--warmup 0`` records the first step
(with the model's loading), ``--warmup 1`` the second; the report lists every step's peak.
"""

import argparse
import linecache
import pickle
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from profile_step import per_rank, workload_args, workload_config  # noqa: E402

GIB = 1024**3
OURS = ("/hone/", "/transformers/", "/peft/", "torchinductor")


def frame_of(frames: list[dict]) -> str:
    """The innermost frame of ours (``file:line: source``), else the innermost Python frame."""
    for f in frames:
        name = f.get("filename", "")
        if any(marker in name for marker in OURS):
            source = linecache.getline(name, f.get("line", 0)).strip()
            short = name[name.rfind("/", 0, name.rfind("/")) + 1 :]
            return f"{short}:{f.get('line')} {f.get('name')}: {source[:120]}"
    return frames[0].get("name", "?") if frames else "(no frame)"


def live_at_peak(events: list[dict]) -> tuple[int, dict[str, list[int]]]:
    """(peak bytes above the step's start, {frame: [bytes, blocks]} of the step's allocations
    alive at that peak), from the allocator's trace of the step."""
    live: dict[int, dict] = {}
    delta = peak = 0
    at_peak: dict[int, dict] = {}
    for e in events:
        action, addr, size = e["action"], e["addr"], e["size"]
        if action == "alloc":
            live[addr] = e
            delta += size
            if delta > peak:
                peak, at_peak = delta, dict(live)
        elif action == "free_requested":
            delta -= size
            live.pop(addr, None)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in at_peak.values():
        g = groups[frame_of(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    return peak, groups


def main() -> None:
    p = argparse.ArgumentParser()
    workload_args(p)
    p.add_argument("--out", type=Path, default=Path("peak.md"))
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--snapshot", type=Path, default=None, help="also keep the raw snapshot (pickle) here")
    args = p.parse_args()
    args.active = 1

    from hone.train.run import run_training

    state = {"step": 0, "start": 0}
    peaks: list[float] = []  # each step's max_memory_allocated (GiB)

    def record() -> None:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)

    def step_callback(metrics) -> None:
        state["step"] += 1
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() / GIB)
        if state["step"] == args.warmup:
            state["start"] = torch.cuda.memory_allocated()
            record()
        elif state["step"] == args.warmup + 1:
            state["snapshot"] = torch.cuda.memory._snapshot()
            state["max"] = torch.cuda.max_memory_allocated()
            torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.reset_peak_memory_stats()

    if args.warmup == 0:  # the first step: loading, compiling and (with CUDA graphs) their first runs
        record()

    with tempfile.TemporaryDirectory() as tmp:
        cfg = workload_config(args, Path(tmp))
        run_training(cfg, device=torch.device(args.device), step_callback=step_callback, save_outputs=False)
    snap = state["snapshot"]
    args.out, args.snapshot = per_rank(args.out), per_rank(args.snapshot)  # under torchrun: one report per rank
    if args.snapshot:
        args.snapshot.write_bytes(pickle.dumps(snap))
    events = [e for trace in snap["device_traces"] for e in trace]
    peak, groups = live_at_peak(events)
    shape = f"DPO pairs {args.pairs}" if args.pairs else f"seq {args.seq}"
    lines = [
        f"# memory at the peak: {args.preset} {shape} mbs {args.mbs}, {' '.join(args.overrides) or 'defaults'}",
        "",
        f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; step {args.warmup + 1}",
        "",
        f"held from before the step: {state['start'] / GIB:.2f} GiB; the step's peak above it: {peak / GIB:.2f} GiB "
        f"(max_memory_allocated over the step: {state['max'] / GIB:.2f} GiB)",
        "",
        "each step's max_memory_allocated, GiB: "
        + ", ".join(f"{p:.2f}" for p in peaks)
        + " (with CUDA graphs a replay allocates nothing: the recording steps hold the peak)",
        "",
        "| allocated at (alive at the peak) | GiB | blocks |",
        "|---|---|---|",
    ]
    for frame, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[: args.top]:
        lines.append(f"| `{frame.replace('|', '/')}` | {size / GIB:.3f} | {count} |")
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
