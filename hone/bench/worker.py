"""One (condition, replicate) of a benchmark, in its own process.

The harness starts ``python -m hone.bench.worker SPEC_JSON CONDITION REPLICATE RESULT_JSON``;
a fresh process per row keeps compile caches, allocator state and CUDA context of one condition
from leaking into the next. hone conditions go through ``run_training`` (the code path of
``hone train``), with random-token data written as a ``pretokenized`` dataset (``data: pairs``: text pairs of
one-token words as a ``preference`` dataset, :mod:`hone.bench.pairs`).
"""

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hone.atomic import atomic_write_text
from hone.bench.flops import mfu
from hone.bench.spec import BenchSpec, Condition, Workload
from hone.units import GIB


def random_batches(workload: Workload, count: int, vocab_size: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    """``count`` micro-batches of random ids; token 0 is avoided (often a special token)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (workload.micro_batch_size, workload.sequence_len)
    return [torch.randint(1, vocab_size, shape, generator=generator).to(device) for _ in range(count)]


def workload_tokenizer(workload: Workload) -> Any:
    """The tokenizer hone loads for the workload's model (a preset's bundled one, or the directory's)."""
    from hone.config.model import ModelConfig
    from hone.models.tokenizer import load_tokenizer

    return load_tokenizer(ModelConfig(preset=workload.preset) if workload.preset is not None else ModelConfig(path=workload.path))


def model_config_and_size(workload: Workload) -> tuple[Any, int, int]:
    """The transformers config (as hone builds it), its parameter count (from a meta-device
    model: no memory used) and the exclusive upper bound for random token ids.

    Ids stay inside the tokenizer's vocabulary because hone checks pretokenized data against
    it; which ids are drawn does not change the cost of a step (the embedding is a gather and
    the loss spans the whole vocabulary either way).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = workload_tokenizer(workload)
    if workload.preset is not None:
        from hone.models.presets import build_preset_config

        overrides = {"num_hidden_layers": workload.layers} if workload.layers else {}
        config = build_preset_config(workload.preset, overrides, vocab_size=len(tokenizer))
    else:
        config = AutoConfig.from_pretrained(workload.path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    id_limit = min(config.vocab_size, len(tokenizer))
    return config, sum(p.numel() for p in model.parameters()), id_limit


def _hone_config(spec: BenchSpec, condition: Condition, workdir: Path, data_file: Path):
    from hone.config import apply_overrides, parse_config

    w = spec.workload
    model: dict[str, Any] = {"dtype": w.dtype}
    if w.preset is not None:
        model["preset"] = w.preset
        if w.layers:
            model["preset_overrides"] = {"num_hidden_layers": w.layers}
        if w.preset_init != "transformers":
            model["preset_init"] = w.preset_init
    else:
        model["path"] = str(w.path)
    adapter = w.adapter.model_dump() if w.adapter.type == "lora" else {"type": "none"}
    raw = {
        "model": model,
        "data": {
            "datasets": [{"path": str(data_file), "type": "preference" if w.data == "pairs" else "pretokenized"}],
            "sequence_len": w.sequence_len,
            "dataset_prepared_path": str(workdir / "cache"),
        },
        "adapter": adapter,
        "training": {
            "micro_batch_size": w.micro_batch_size,
            "gradient_accumulation_steps": w.gradient_accumulation_steps,
            "max_steps": spec.warmup_steps + spec.timed_steps,
            "output_dir": str(workdir / "run"),
            "seed": spec.seed,
            "max_grad_norm": None,
        },
        "optimizer": {"learning_rate": 1e-4, "lr_scheduler": "constant"},
        "logging": {"tensorboard": False, "plot": False, "progress_bar": False},
    }
    if w.data == "pairs":
        raw["training"]["objective"] = w.objective
    return parse_config(apply_overrides(raw, condition.overrides), f"condition '{condition.name}'")


def _estimated_peak_gib(cfg: Any, device: torch.device, pair_splits: tuple = ()) -> float | None:
    """hone's estimate of this row's peak (as the run decides it: with ``pair_splits``, the pairs'
    statistics), recorded beside the measured one so every bench checks the estimate. A failing
    estimate must not cost the measurement."""
    from hone.runtime.world import world_from_env
    from hone.transforms.decide import decided_estimate

    try:  # this rank's step: the world torchrun launched it in (FSDP2 shards, expert blocks)
        est = decided_estimate(cfg, device.type, world=world_from_env(), pair_splits=pair_splits)
    except Exception as exc:  # noqa: BLE001 - reported on stderr, the row goes on
        print(f"hone bench: no memory estimate for this row: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return round(est.total / GIB, 2)


def _write_random_dataset(path: Path, batches: list[torch.Tensor]) -> None:
    with path.open("w") as f:
        for batch in batches:
            for row in batch.tolist():
                f.write(json.dumps({"input_ids": row}) + "\n")


def _trained_bins_efficiency(cache: Path) -> float | None:
    """Packing efficiency of the bins the run trained on: the ones ``hone.data`` packed once and
    saved with the row's prepared data (the row's cache directory holds that one entry)."""
    from hone.data.packing import PACKING_FILES, load_packing

    saved = sorted(cache.glob(f"*/{PACKING_FILES['train']}"))
    packing = load_packing(saved[0]) if len(saved) == 1 else None
    return packing.efficiency if packing is not None else None


def run_condition(spec: BenchSpec, condition: Condition, replicate: int, world_size: int = 1) -> dict[str, Any]:
    """Run one row and return its measurements (raises on failure; the harness records it)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    w = spec.workload
    total_steps = spec.warmup_steps + spec.timed_steps
    config, total_params, id_limit = model_config_and_size(w)
    seed = spec.seed + 1000 * replicate
    step_times: list[float] = []
    losses: list[float] = []
    step_tokens: list[tuple[int, int]] = []  # (real, trained) tokens per step, hone rows
    attention_len: float = float(w.sequence_len)
    packing_efficiency: float | None = None
    compile_stats: dict[str, Any] | None = None
    decided: dict[str, Any] | None = None
    estimated_gib: float | None = None
    split = 1  # ranks each row is split over (distributed.context_parallel): a rank trains 1/split of its tokens

    if condition.reference is not None:

        def on_step(step: int, seconds: float, loss: float | None) -> None:
            step_times.append(seconds)
            losses.append(float("nan") if loss is None else loss)

        if condition.reference == "trl-dpo":
            from hone.bench.trl_reference import run_trl_dpo

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            run_trl_dpo(config, spec, condition, device, on_step)
        else:
            from hone.bench.reference import run_reference

            batches = random_batches(w, total_steps * w.gradient_accumulation_steps, id_limit, seed, device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            run_reference(config, w, condition, batches, total_steps, device, seed, on_step)
    else:
        from hone.train.run import run_training
        from hone.transforms.allocator import configure_allocator

        with tempfile.TemporaryDirectory(prefix="hone-bench-") as tmp:
            workdir = Path(tmp)
            data_file = workdir / "random.jsonl"
            cpu = torch.device("cpu")
            pair_splits: tuple = ()
            if w.data == "lengths":
                from hone.bench.lengths import attention_span, write_length_mix

                lengths = write_length_mix(data_file, w, id_limit, spec.seed)
                attention_len = attention_span(lengths)
            elif w.data == "pairs":
                from hone.bench.pairs import pair_stats, write_pairs

                write_pairs(data_file, w, workload_tokenizer(w), total_steps * w.pairs_per_step * world_size, seed)
                pair_splits = (pair_stats(w, total_steps * w.pairs_per_step * world_size),)
                attention_len = float(w.prompt_len + w.completion_len)  # the pair's two sequences attend apart
            else:
                _write_random_dataset(
                    data_file, random_batches(w, total_steps * w.gradient_accumulation_steps * world_size, id_limit, seed, cpu)
                )  # every rank reads its own part
            cfg = _hone_config(spec, condition, workdir, data_file)
            split = cfg.distributed.context_parallel
            configure_allocator(cfg, device.type)  # as hone train does, before CUDA starts
            estimated_gib = _estimated_peak_gib(cfg, device, pair_splits)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            last = [None]

            def step_callback(metrics: Any) -> None:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.perf_counter()
                get = metrics.get if isinstance(metrics, dict) else lambda k, d=None: getattr(metrics, k, d)
                if last[0] is None:
                    step_times.append(float(get("step_time_s")))
                else:
                    step_times.append(now - last[0])
                last[0] = now
                loss = get("loss")
                losses.append(float(loss) if loss is not None else float("nan"))
                step_tokens.append((int(get("tokens", 0)), int(get("trained_tokens", 0))))

            run_training(cfg, device=device, step_callback=step_callback, save_outputs=False)
            if w.data == "lengths" and cfg.data.sample_packing:
                packing_efficiency = _trained_bins_efficiency(workdir / "cache")
            record = workdir / "run" / "optimizations.json"
            if record.exists():  # compile counts (graphs, recompiles) and what every auto took, for the row
                written = json.loads(record.read_text())
                compile_stats = written.get("compile")
                decided = decided_values(written.get("decided", {}))

    timed = step_times[spec.warmup_steps :]
    if len(timed) < spec.timed_steps:
        raise RuntimeError(f"only {len(step_times)} steps reported, expected {total_steps}")
    median_s = statistics.median(timed)
    tokens = w.tokens_per_step // split  # this rank's: the ranks' rows add up to the tokens trained
    tokens_per_s = trained_per_s = tokens / median_s  # random data: every token is trained
    reference_forward = False
    if w.data == "pairs":  # a pair trains its two completions; DPO and IPO run a reference forward too
        trained_per_s = 2 * w.completion_len * w.pairs_per_step / median_s
        precomputed = condition.precompute_ref or condition.set.get("training.preference.reference") == "precomputed"
        reference_forward = w.objective != "orpo" and not precomputed
    trained_at_median: float | None = None
    if w.data == "lengths":  # steps differ in size: what the timed steps did over their time
        timed_tokens = step_tokens[spec.warmup_steps :]
        tokens_per_s = sum(t for t, _ in timed_tokens) / sum(timed)
        trained_per_s = sum(t for _, t in timed_tokens) / sum(timed)
        # the typical step, without one-off stalls (a recompile, an allocator retry) in the sum
        trained_at_median = statistics.mean(t for _, t in timed_tokens) / median_s
    full_ft = w.adapter.type == "none"
    utilisation = mfu(config, total_params, round(attention_len), full_ft, tokens_per_s, spec.peak_tflops, reference_forward)
    row: dict[str, Any] = {
        "median_ms": round(median_s * 1000, 2),
        "min_ms": round(min(timed) * 1000, 2),
        "max_ms": round(max(timed) * 1000, 2),
        "first_step_s": round(step_times[0], 2),
        "tokens_per_s": round(tokens_per_s, 1),
        "trained_tokens_per_s": round(trained_per_s, 1),
        "mfu_pct": float(f"{100 * utilisation:.3g}"),
        "final_loss": round(losses[-1], 4) if losses else None,
        # every step's, warm-up included: hone's rows of one spec train the same rows in the same
        # order from the same weights, so where their curves part is where the math changed
        "losses": [round(loss, 5) for loss in losses],
        # every step's time, warm-up included: a wide min-max spread says which steps stalled
        # (a recompile, a collective waiting on another rank) and whether it repeats
        "step_ms": [round(t * 1000, 1) for t in step_times],
        "total_params": total_params,
    }
    if w.data == "pairs":
        row["pairs_per_s"] = round(w.pairs_per_step / median_s, 3)
    if condition.reference is None:
        row["estimated_peak_gib"] = estimated_gib
    if trained_at_median is not None:
        row["trained_tokens_per_s_at_median"] = round(trained_at_median, 1)
    if packing_efficiency is not None:
        row["packing_efficiency"] = round(packing_efficiency, 4)
    if compile_stats is not None:
        row["compile"] = compile_stats
    if decided is not None:
        row["decided"] = decided
    row["peak_host_gib"] = peak_host_gib()
    if device.type == "cuda":
        from hone.train.device import memory_reading

        memory = memory_reading(device)
        row["peak_alloc_gib"] = round(memory.peak_allocated_gib, 2)
        row["peak_reserved_gib"] = round(memory.peak_reserved_gib, 2)
        # the whole run's: a slow row at the card's limit shows here (hone.train.allocator_watch)
        row["alloc_retries"] = memory.alloc_retries
        row["device"] = torch.cuda.get_device_name()
    else:
        row["peak_alloc_gib"] = row["peak_reserved_gib"] = None
        row["device"] = "cpu"
    return row


def decided_values(decided: dict[str, Any]) -> dict[str, Any]:
    """The plan's decisions as a row keeps them: every value, none of the reasons (those are in
    the run's ``optimizations.json``), so that a defaults row says what ``auto`` took."""
    return {key: value for key, value in decided.items() if not key.endswith(("_why", "_skipped"))}


def peak_host_gib() -> float | None:
    """This process's peak resident memory in GiB (``ru_maxrss``: KiB on Linux, bytes on macOS):
    pinned host buffers are resident, so offloaded layer inputs are in it. None where the
    platform has no ``resource`` module."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**30 if sys.platform == "darwin" else 2**20), 2)


def compile_cache_dir(condition: Condition, spec_file: Path) -> Path:
    """An empty directory (``cold``), or the bench run's shared one (``shared``), for Inductor's
    and Triton's caches; set through TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR before anything
    compiles, so no row's cold start is shortened by kernels an earlier row (or an earlier bench)
    left on the machine."""
    if condition.compile_cache == "shared":
        path = spec_file.parent / "inductor-shared"
        path.mkdir(exist_ok=True)
        return path
    return Path(tempfile.mkdtemp(prefix="hone-inductor-"))


def use_compile_cache(cache: Path) -> None:
    """Point Inductor's caches and Triton's at ``cache`` (before anything compiles). Triton's
    too, hone's own kernels included: left unset, hone's kernels compiled before Inductor first
    loads a compiled graph (every eager row) use ~/.triton/cache, warm from earlier rows and
    runs, while Inductor points TRITON_CACHE_DIR at its own cache as soon as it loads one."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")


def main(argv: list[str]) -> int:
    spec_file, condition_name, replicate, result_file = argv
    spec = BenchSpec.model_validate_json(Path(spec_file).read_text())
    condition = next(c for c in spec.conditions if c.name == condition_name)
    cache = compile_cache_dir(condition, Path(spec_file))
    use_compile_cache(cache)
    from hone.runtime.world import world_from_env
    from hone.train.distributed import close_world, init_world

    world = world_from_env()  # torchrun's, for an nproc > 1 condition
    if world.distributed:
        init_world(
            "cuda" if torch.cuda.is_available() else "cpu", cpu_collectives=bool(condition.set.get("distributed.cpu_offload"))
        )
        result_file = str(Path(result_file).with_name(f"{Path(result_file).stem}.rank{world.rank}.json"))
    try:
        row = run_condition(spec, condition, int(replicate), world.world_size)
    finally:
        close_world()
        if condition.compile_cache == "cold":
            import shutil

            shutil.rmtree(cache, ignore_errors=True)
    row["compile_cache"] = condition.compile_cache
    atomic_write_text(Path(result_file), json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
