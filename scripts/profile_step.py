"""Profile hone's training step on a GPU: the top kernels by time and the GEMM share.

    python scripts/profile_step.py --preset qwen3-8b --seq 2048 --set performance.torch_compile=true \
        --out profile.md [--trace trace.json]
    python scripts/profile_step.py --preset qwen3-8b --pairs 512,768 --out dpo.md   # a DPO step on pairs

Runs ``run_training`` (the code path of ``hone train``) on random tokens, records steps
``warmup+1 .. warmup+active`` with ``torch.profiler`` and writes a markdown table: kernels
grouped by name, their share of device time, and GEMM (matmul) time against everything else.
Not a benchmark (the profiler adds overhead); use ``hone bench`` for step times.

Under ``torchrun --nproc-per-node N scripts/profile_step.py ... --set distributed.strategy=ddp``
every rank profiles its own steps and writes ``OUT`` with ``.rankR`` before the suffix (rank 0
also prints its table), so a data-parallel step's communication and waits can be read per rank;
``--overlap`` adds how much of the NCCL kernels' time ran beside compute (scripts/comm_overlap.py).
"""

import argparse
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import yaml

ATTENTION = re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)
GEMM = re.compile(r"gemm|cutlass|sm90_xmma|nvjet|wgmma|_mm_|matmul|cublas", re.I)


def _pair_workload(pairs: str | None) -> dict:
    """The workload keys of ``--pairs PROMPT,COMPLETION`` (DPO; each sequence prompt + completion)."""
    if not pairs:
        return {}
    prompt, completion = (int(n) for n in pairs.split(","))
    return {
        "data": "pairs",
        "prompt_len": prompt,
        "completion_len": completion,
        "objective": "dpo",
        "sequence_len": prompt + completion,
    }


def workload_args(p: argparse.ArgumentParser) -> None:
    """The arguments that say which run to build (shared with scripts/memory_at_peak.py)."""
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers (a slice of a big model)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--full", action="store_true", help="a full fine-tune (no adapter; --targets is unused)")
    p.add_argument(
        "--pairs",
        default=None,
        metavar="PROMPT,COMPLETION",
        help="profile DPO on preference pairs of these token lengths (as the bench's `data: pairs`; --seq is unused)",
    )
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself on a tiny preset")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--active", type=int, default=2)


def per_rank(path: Path | None) -> Path | None:
    """``path`` with ``.rankR`` before its suffix under torchrun (each rank writes its own file);
    as it is in one process."""
    if path is None or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return path
    return path.with_name(f"{path.stem}.rank{os.environ.get('RANK', '0')}{path.suffix}")


def workload_config(args: argparse.Namespace, work: Path):
    """The config of the run ``args`` describe, its random data written under ``work``: enough
    for ``warmup + active + 1`` optimizer steps (the bench's random tokens or pairs)."""
    from hone.bench.pairs import write_pairs
    from hone.bench.spec import parse_spec
    from hone.bench.worker import _hone_config, _write_random_dataset, model_config_and_size, random_batches, workload_tokenizer

    spec = parse_spec(
        {
            "name": "profile",
            "workload": {
                "preset": args.preset,
                **({"layers": args.layers} if args.layers else {}),
                "sequence_len": args.seq,
                **_pair_workload(args.pairs),
                "micro_batch_size": args.mbs,
                "gradient_accumulation_steps": args.accum,
                "adapter": {"type": "none"}
                if args.full
                else {"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": args.targets.split(",")},
            },
            "conditions": [{"name": "hone", "set": {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.overrides)}}],
            "warmup_steps": args.warmup,
            "timed_steps": args.active + 1,
        },
        "flags",
    )
    _, _, id_limit = model_config_and_size(spec.workload)
    count = (args.warmup + args.active + 1) * args.accum * int(os.environ.get("WORLD_SIZE", "1"))
    data = work / "random.jsonl"
    if args.pairs:
        write_pairs(data, spec.workload, workload_tokenizer(spec.workload), count * spec.workload.pairs_per_step, 0)
    else:
        _write_random_dataset(data, random_batches(spec.workload, count, id_limit, 0, torch.device("cpu")))
    return _hone_config(spec, spec.conditions[0], work, data)


def _python_frames(evt, keep: int = 3) -> str:
    """The innermost hone/transformers frames above ``evt`` (recorded with --stacks only): where a
    sync was asked for, beyond the op that asked (runtime calls carry no stack of their own)."""
    node = evt
    while node is not None and not getattr(node, "stack", None):
        node = node.cpu_parent
    if node is None:
        return ""
    frames = [f for f in node.stack if "hone/" in f or "transformers/" in f][:keep]
    return f" [{' < '.join(frames)}]" if frames else ""


def main() -> None:
    p = argparse.ArgumentParser()
    workload_args(p)
    p.add_argument("--out", type=Path, default=Path("profile.md"))
    p.add_argument("--trace", type=Path, default=None)
    p.add_argument(
        "--overlap", action="store_true", help="add the share of NCCL kernel time beside compute (scripts/comm_overlap.py)"
    )
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--gaps", action="store_true", help="add where the device sat idle and what the host did then (scripts/idle_gaps.py)"
    )
    p.add_argument("--stacks", action="store_true", help="record Python stacks too (slows the host: for where, not how much)")
    args = p.parse_args()

    from hone.train.run import run_training

    sched = torch.profiler.schedule(wait=args.warmup, warmup=0, active=args.active, repeat=1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = workload_config(args, Path(tmp))
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
            schedule=sched,
            with_stack=args.stacks,
        ) as prof:
            run_training(cfg, device=torch.device(args.device), step_callback=lambda m: prof.step())
    rank = int(os.environ.get("RANK", "0"))
    args.out, args.trace = per_rank(args.out), per_rank(args.trace)
    gaps_text = ""
    if args.trace or args.gaps or args.overlap:
        trace = args.trace or Path(tempfile.mkdtemp()) / "trace.json"
        prof.export_chrome_trace(str(trace))
        sys.path.insert(0, str(Path(__file__).parent))
        if args.gaps:
            from idle_gaps import summarize

            gaps_text = "\n## Device idle gaps (over the profiled steps)\n\n" + summarize(trace, depth=4)
        if args.overlap:
            from comm_overlap import summarize as overlap_summary

            gaps_text += "\n## Communication beside compute (over the profiled steps)\n\n" + overlap_summary(trace) + "\n"
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():  # kernels and copies only: CPU ranges (ProfilerStep#, ops) carry no device time of their own
        if evt.device_type != torch.autograd.DeviceType.CUDA or evt.name.startswith(("ProfilerStep", "hone:")):
            continue
        by_name[evt.name][0] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
        by_name[evt.name][1] += 1
    # host-device synchronisations the step asked for (CUDA runtime calls that block the host)
    syncs: dict[str, int] = defaultdict(int)
    sync_callers: dict[str, int] = defaultdict(int)
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA and "ynchronize" in evt.name and evt.name.startswith("cuda"):
            syncs[evt.name] += 1
            chain, parent = [], evt.cpu_parent
            while parent is not None and len(chain) < 4:
                chain.append(parent.name)
                parent = parent.cpu_parent
            sync_callers[f"{evt.name} <- {' <- '.join(chain) or '?'}{_python_frames(evt)}"] += 1
        elif evt.device_type != torch.autograd.DeviceType.CUDA and evt.name == "cudaMemcpyAsync":
            syncs["cudaMemcpyAsync (any direction)"] += 1
    total = sum(v[0] for v in by_name.values()) or 1.0  # a CPU dry run records no device time
    shape = f"DPO pairs {args.pairs}" if args.pairs else f"seq {args.seq}"
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    attn = sum(v[0] for k, v in by_name.items() if ATTENTION.search(k))
    gemm = sum(v[0] for k, v in by_name.items() if GEMM.search(k) and not ATTENTION.search(k))
    lines = [
        f"# profile: {args.preset} {shape} mbs {args.mbs}, {' '.join(args.overrides) or 'defaults'}",
        "",
        f"device {device_name}, torch {torch.__version__}; {args.active} steps profiled; "
        f"device time per step {total / args.active / 1000:.1f} ms",
        "",
        f"GEMM {100 * gemm / total:.1f}% | attention {100 * attn / total:.1f}% | "
        f"other {100 * (total - gemm - attn) / total:.1f}%",
        "",
        f"host syncs per optimizer step ({args.accum} micro-batch(es)): "
        + (", ".join(f"{k} {v / args.active:g}" for k, v in sorted(syncs.items())) or "none"),
        "",
        *(f"- {caller}: {n / args.active:g} per step" for caller, n in sorted(sync_callers.items())),
        "",
        "| kernel | ms/step | share | calls/step |",
        "|---|---|---|---|",
    ]
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[: args.top]:
        short = name if len(name) < 110 else name[:107] + "..."
        lines.append(f"| `{short}` | {t / args.active / 1000:.2f} | {100 * t / total:.1f}% | {n // args.active} |")
    text = "\n".join(lines) + "\n" + gaps_text
    args.out.write_text(text)
    if rank == 0:
        print(text)
    print(f"rank {rank}:", json.dumps({"total_ms_per_step": total / args.active / 1000, "gemm_share": gemm / total}))


if __name__ == "__main__":
    main()
