"""Where hone's first training step spends its time: Dynamo, AOT autograd, Inductor, Triton
compiles (Inductor's and hone's own kernels), hone's kernel autotuning, and the rest.

    python scripts/first_step_breakdown.py --preset qwen3-30b-a3b --layers 8 --seq 2048 \\
        --set model.experts_implementation=hone --set performance.torch_compile=true \\
        --set 'performance.torch_compile_options={triton.cudagraphs: true}'

Runs ``run_training`` (the path of ``hone train`` and ``hone bench``; model build excluded from
the step times) for ``--steps`` steps on random tokens, LoRA r16 on ``--targets`` (default
attention and every expert), and prints:

- the wall time of each step (step 1 is the one ``hone bench`` reports as "first step s");
- per compiled frame (forward and backward): Dynamo, AOT autograd, Inductor and Inductor's
  Triton compile times, guards, graph inputs, FX-graph / AOT-autograd cache hit/miss/bypass
  (with the bypass reasons), recompile reasons;
- Triton compiles seen by Triton's compilation listener (Inductor's kernels and hone's), grouped
  by kernel, and hone's kernel autotuning (time and configs timed per tuning key);
- with ``--cprofile FILE``: the model build and the first step under cProfile (the top
  functions by cumulative time).

Inductor compiles its own Triton kernels in worker processes, which Triton's listener in this
process does not see (their time is in the frames' "triton compile" column); hone's kernels
compile in this process, on their first launch.

Caches: ``--cache-dir DIR`` points Inductor's and Triton's on-disk caches at ``DIR`` (created;
reuse it in a second run to measure warm caches), ``--cold`` at a fresh empty directory (the
default uses whatever the environment has: ``~/.triton/cache`` and ``/tmp/torchinductor_$USER``).

On a CPU (no GPU) it runs too: hone's kernels need ``TRITON_INTERPRET=1`` (and triton), so keep
the model tiny, e.g. ``--preset tiny-qwen3-moe --layers 8 --seq 32 --override num_experts=128
--override num_experts_per_tok=8 --dtype float32``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,experts")
    p.add_argument("--override", action="append", default=[], help="preset_overrides KEY=VALUE (e.g. num_experts=128)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="hone config KEY=YAML (as hone bench's set:)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--cold", action="store_true", help="fresh empty Inductor and Triton caches")
    p.add_argument("--cache-dir", type=Path, default=None, help="Inductor and Triton caches here (reuse for a warm run)")
    p.add_argument("--cprofile", type=Path, default=None, help="cProfile the first step, write the stats here")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json", type=Path, default=None, help="also write the numbers as JSON here")
    return p.parse_args()


def _set_cache_dirs(args: argparse.Namespace) -> str | None:
    """Before torch or triton is imported: their cache locations are read at import / first use."""
    root = args.cache_dir
    if args.cold and root is None:
        root = Path(tempfile.mkdtemp(prefix="hone-first-step-"))
    if root is None:
        return None
    root.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    return str(root)


class _TritonWatch:
    """Triton's public listeners (``triton.knobs``): every compile (any kernel: Inductor's and
    hone's) and every autotuning of a ``triton.autotune`` kernel (hone's)."""

    def __init__(self) -> None:
        self.compiles: dict[str, list[float]] = defaultdict(list)  # kernel -> compile seconds
        self.variants: dict[str, list[str]] = defaultdict(list)  # kernel -> constexprs of each compile
        self.autotunes: list[dict[str, Any]] = []
        self.active = False

    def install(self) -> None:
        try:
            from triton import knobs
        except ImportError:
            return
        compilation = getattr(knobs, "compilation", None)
        autotuning = getattr(knobs, "autotuning", None)
        if compilation is not None and hasattr(compilation, "listener"):
            compilation.listener = self._on_compile
            self.active = True
        if autotuning is not None and hasattr(autotuning, "listener"):
            autotuning.listener = self._on_autotune

    def _on_compile(self, *args: Any, **kw: Any) -> None:
        try:  # a listener must never break the compile it watches
            src, metadata = kw.get("src"), kw.get("metadata") or {}
            name = getattr(src, "name", None) or str(metadata.get("name", "?"))
            label = f"{name}{' (cache hit)' if kw.get('cache_hit') else ''}"
            seconds = kw["times"].total / 1e6
            self.compiles[label].append(seconds)
            self.variants[label].append(str(getattr(src, "constexprs", ""))[:400])
        except Exception as exc:  # noqa: BLE001
            self.compiles[f"(listener failed: {type(exc).__name__})"].append(0.0)

    def _on_autotune(self, *args: Any, **kw: Any) -> None:
        try:
            self.autotunes.append(
                {
                    "kernel": getattr(kw.get("fn"), "__name__", str(kw.get("fn"))),
                    "key": [str(k) for k in kw.get("key") or ()],
                    "configs_timed": len(kw.get("configs_timings") or {}),
                    "seconds": kw.get("duration"),
                    "cache_hit": kw.get("cache_hit"),
                    "best": str(kw.get("best_config")),
                }
            )
        except Exception as exc:  # noqa: BLE001
            self.autotunes.append(
                {
                    "kernel": f"(listener failed: {type(exc).__name__})",
                    "key": [],
                    "configs_timed": 0,
                    "seconds": 0,
                    "cache_hit": None,
                    "best": "",
                }
            )


def _metrics_since(start: int) -> list[Any]:
    import torch._dynamo.utils as dutils

    getter = getattr(dutils, "get_compilation_metrics", None)
    metrics = list(getter()) if getter is not None else []
    return metrics[start:]


def _s(us: Any) -> float:
    return (us or 0) / 1e6


def _frames_table(metrics: list[Any]) -> tuple[list[str], dict[str, float]]:
    lines = [
        "| compile id | frame | fwd/bwd | total s | dynamo s | aot s | inductor s | inductor codegen s | triton compile s | "
        "guards | graph inputs | ops | fx cache (hit/miss) | aot cache (hit/miss) | fail / recompile reason |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    totals: dict[str, float] = Counter()
    for m in metrics:
        g = lambda k: getattr(m, k, None)  # noqa: E731 - fields differ between torch versions
        total = g("entire_frame_compile_time_s") or _s(g("duration_us"))
        kind = {True: "fwd", False: "bwd", None: ""}[g("is_forward")]
        if g("is_runtime"):
            kind = "runtime"
        reason = (g("fail_reason") or g("recompile_reason") or "")[:120].replace("\n", " ").replace("|", "/")
        lines.append(
            f"| {g('compile_id')} | {g('co_name') or ''} | {kind} | {total or 0:.2f} | "
            f"{_s(g('dynamo_cumulative_compile_time_us')):.2f} | "
            f"{_s(g('aot_autograd_cumulative_compile_time_us')):.2f} | {_s(g('inductor_cumulative_compile_time_us')):.2f} | "
            f"{_s(g('inductor_code_gen_cumulative_compile_time_us')):.2f} | {_s(g('triton_compile_time_us')):.2f} | "
            f"{g('guard_count') or ''} | {g('graph_input_count') or ''} | {g('graph_op_count') or ''} | "
            f"{g('inductor_fx_local_cache_hit_count') or 0}/{g('inductor_fx_local_cache_miss_count') or 0} | "
            f"{g('aotautograd_local_cache_hit_count') or 0}/{g('aotautograd_local_cache_miss_count') or 0} | {reason} |"
        )
        if not g("is_runtime"):
            totals["frames total"] += total or 0
        totals["dynamo"] += _s(g("dynamo_cumulative_compile_time_us"))
        totals["aot autograd (incl. inductor)"] += _s(g("aot_autograd_cumulative_compile_time_us"))
        totals["inductor (incl. codegen, triton)"] += _s(g("inductor_cumulative_compile_time_us"))
        totals["inductor codegen"] += _s(g("inductor_code_gen_cumulative_compile_time_us"))
        totals["inductor's triton compile"] += _s(g("triton_compile_time_us"))
        totals["runtime triton autotune (inductor)"] += _s(g("runtime_triton_autotune_time_us"))
        totals["runtime cudagraphify"] += _s(g("runtime_cudagraphify_time_us"))
    return lines, dict(totals)


class _BypassLog:
    """Collects the reasons Inductor / AOT autograd give for not caching a graph (their INFO logs)."""

    def __init__(self) -> None:
        import logging

        self.reasons: Counter[str] = Counter()
        outer = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                text = record.getMessage()
                if "ypass" in text:
                    outer.reasons[text[:300]] += 1

        self.handler = Handler(level=logging.INFO)
        for name in ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache"):
            logger = logging.getLogger(name)
            logger.addHandler(self.handler)
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
            logger.propagate = False


def _condition_set(args: argparse.Namespace, yaml: Any) -> dict[str, Any]:
    """The config overrides of the run: ``--set``, the preset overrides and the step count."""
    overrides = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    preset = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.override)}
    overrides["model.preset_overrides"] = {"num_hidden_layers": args.layers, **preset}
    overrides["training.max_steps"] = args.steps
    return overrides


def main() -> None:
    args = _parse()
    cache_root = _set_cache_dirs(args)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import torch
    import yaml

    from hone.bench.spec import parse_spec
    from hone.bench.worker import _hone_config, _write_random_dataset, model_config_and_size, random_batches
    from hone.train.run import run_training

    watch = _TritonWatch()
    watch.install()
    bypass = _BypassLog()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = parse_spec(
        {
            "name": "first-step",
            "workload": {
                "preset": args.preset,
                "layers": args.layers,
                "sequence_len": args.seq,
                "micro_batch_size": args.mbs,
                "dtype": args.dtype,
                "adapter": {"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": args.targets.split(",")},
            },
            "conditions": [{"name": "hone", "set": _condition_set(args, yaml)}],
            "warmup_steps": 1,  # spec bookkeeping only: max_steps is set below
            "timed_steps": 1,
        },
        "flags",
    )
    cond = spec.conditions[0]
    _, _, id_limit = model_config_and_size(spec.workload)
    from torch._dynamo.utils import get_compilation_metrics

    start_metrics = len(list(get_compilation_metrics()))
    step_times: list[float] = []
    profiler = cProfile.Profile() if args.cprofile else None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "random.jsonl"
        _write_random_dataset(data, random_batches(spec.workload, args.steps, id_limit, 0, torch.device("cpu")))
        cfg = _hone_config(spec, cond, work, data)
        last = [time.perf_counter()]

        def on_step(metrics: Any) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            get = metrics.get if isinstance(metrics, dict) else lambda k, d=None: getattr(metrics, k, d)
            step_times.append(float(get("step_time_s")) if not step_times else now - last[0])
            last[0] = now
            if profiler is not None and len(step_times) == 1:
                profiler.disable()

        if profiler is not None:
            # The profile starts at the model build (excluded from the step time, included here).
            profiler.enable()
        run_training(cfg, device=device, step_callback=on_step)

    metrics = _metrics_since(start_metrics)
    table, totals = _frames_table(metrics)
    out: list[str] = [
        f"# first step: {args.preset} x{args.layers} layers, seq {args.seq}, {' '.join(args.overrides) or 'defaults'}",
        f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
        f"caches {cache_root or 'default locations'}",
        "",
        "steps (s): " + ", ".join(f"{t:.2f}" for t in step_times),
        "",
        "## compile totals (s)",
        "",
        *(f"- {k}: {v:.2f}" for k, v in totals.items()),
        f"- triton compiles seen by the listener: {sum(sum(v) for v in watch.compiles.values()):.2f} s "
        f"in {sum(len(v) for v in watch.compiles.values())} compiles"
        + ("" if watch.active else " (this triton has no compilation listener)"),
        "- hone autotuning (benchmarking, compiles of the timed configs included): "
        f"{sum(a['seconds'] or 0 for a in watch.autotunes):.2f} s over {len(watch.autotunes)} tuning keys",
        "",
        "## compiled frames",
        "",
        *table,
        "",
        "## cache bypasses",
        "",
        *(f"- {n}x {r}" for r, n in bypass.reasons.most_common()),
        "",
        "## triton compiles by kernel (s, count)",
        "",
        *(f"- {k}: {sum(v):.2f} s, {len(v)}" for k, v in sorted(watch.compiles.items(), key=lambda kv: -sum(kv[1]))[: args.top]),
        "",
        "## hone kernel autotuning",
        "",
        *(
            f"- {a['kernel']} key {a['key']}: {a['configs_timed']} configs, "
            f"{a['seconds'] or 0:.2f} s{' (cache hit)' if a['cache_hit'] else ''}, best {a['best']}"
            for a in watch.autotunes
        ),
    ]
    try:
        from torch._dynamo.utils import compile_times

        out += [
            "",
            "## torch._dynamo.utils.compile_times() (cumulative s)",
            "",
            "```",
            compile_times(repr="str", aggregate=True),
            "```",
        ]
    except Exception as exc:  # noqa: BLE001 - a diagnostic; the rest is printed anyway
        out += [f"(compile_times unavailable: {exc})"]
    if profiler is not None:
        profiler.dump_stats(args.cprofile)
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(args.top)
        out += ["", "## cProfile of model build + first step (cumulative)", "", "```", buf.getvalue(), "```"]
    print("\n".join(out))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "step_times_s": step_times,
                    "totals_s": totals,
                    "autotunes": watch.autotunes,
                    "bypass": dict(bypass.reasons),
                    "triton_compiles": {k: {"seconds": v, "constexprs": watch.variants[k]} for k, v in watch.compiles.items()},
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
