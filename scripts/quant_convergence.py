"""Convergence of quantized bases: the same LoRA run in bf16 and on a quantized base, final eval
losses side by side (issue 15: within 2% of bf16).

Not a test. By default, on the bundled chat sample (examples/data/chat_sample.jsonl):

1. ``--pretrain-steps`` of a full bf16 fine-tune of a small random Qwen3 (``--hidden`` 1024, 8 layers,
   every linear layer a multiple of NF4's 16,384-weight groups), saved as a model directory: a
   base that has learned something, so quantizing it loses something (a random base's LoRA run
   compares little);
2. for each mode, ``--steps`` of LoRA (r 32 on all linear layers) from that base, with the
   mode's config overrides: ``bf16`` (none) and ``nf4`` (``model.quantize=nf4``), plus any
   ``--mode NAME=key=value[,key=value...]`` (e.g. ``--mode fp8-rowwise=performance.fp8=rowwise``);
3. prints a markdown table: final eval loss, its relative difference from bf16, tok/s, peak GiB.

``--seed 0 1 2`` runs the whole comparison once per seed (each its own base, under
``--out``/seed-N) and ends with each mode's mean and range of its difference from bf16: the
difference of one run is within the spread between runs (session 26: -0.94% to +0.50% for
float8 tensorwise over three seeds), so a criterion such as "within 1%" wants several.

``--set key=value`` overrides apply to every LoRA run (e.g. ``--set performance.torch_compile=true``).
``--rounded-base tensorwise`` (or ``rowwise``) adds the mode ``bf16-rounded-<scaling>``: bf16 LoRA on a
copy of the pretrained base whose decoder-layer projections hold their float8-rounded values
(quantized and dequantized as the fp8 transform quantizes them), which separates what rounding
the frozen weights does from what float8 does to the activations and gradients.
Each mode runs in this process one after the other; ``--pretrain-steps 0`` skips step 1 and
trains LoRA on the random preset with its head trained in full (``lora_modules_to_save``).

    PYTHONPATH=$PWD python scripts/quant_convergence.py                       # ~5 min on an H100 (hidden 1024)
    PYTHONPATH=$PWD python scripts/quant_convergence.py --steps 300 --mode fp8-rowwise=performance.fp8=rowwise
    PYTHONPATH=$PWD python scripts/quant_convergence.py --seed 0 1 2 --only fp8 --mode fp8=performance.fp8=tensorwise
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from hone.config import parse_config
from hone.config.loader import apply_overrides
from hone.track.metrics import read_metrics
from hone.train.run import run_training

ROOT = Path(__file__).resolve().parents[1]


def small_model(hidden: int = 512, layers: int = 8) -> dict[str, int]:
    """A small Qwen3 of width ``hidden`` (heads of 64, intermediate 3x): with ``hidden`` a multiple
    of 512 every linear layer is a multiple of NF4's 16,384-weight groups."""
    return {
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 128),
        "head_dim": 64,
    }


SMALL = small_model()
BUILTIN_MODES = {"bf16": [], "nf4": ["model.quantize=nf4"]}


def _raw(out_dir: Path, steps: int, seed: int, shape: dict[str, int] = SMALL) -> dict[str, Any]:
    return {
        "model": {"preset": "tiny-qwen3", "preset_overrides": shape, "dtype": "bfloat16"},
        "data": {
            "datasets": [{"path": str(ROOT / "examples/data/chat_sample.jsonl"), "type": "chat"}],
            "sequence_len": 256,
            "val_set_size": 0.05,
            "dataset_prepared_path": str(out_dir / "prepared"),
        },
        "adapter": {"type": "lora", "lora_r": 32, "lora_alpha": 32, "lora_target_modules": "all-linear"},
        "training": {"max_steps": steps, "micro_batch_size": 16, "eval_steps": max(steps // 4, 1), "seed": seed},
        "optimizer": {"learning_rate": 1e-3, "lr_scheduler": "cosine", "warmup_steps": max(steps // 20, 1)},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
    }


def _run(raw: dict[str, Any], overrides: list[str], output_dir: Path) -> dict[str, Any]:
    if output_dir.exists():
        shutil.rmtree(output_dir)
    raw = apply_overrides(raw, [*overrides, f"training.output_dir={output_dir}"])
    cfg = parse_config(raw)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    result = run_training(cfg, console=Console(quiet=True))
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    torch._dynamo.reset()
    losses = [r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r and "eval_loss" not in r]
    return {
        "eval": result.last_eval_loss,
        "train_end": sum(losses[-30:]) / max(1, len(losses[-30:])),
        "first_eval": result.first_eval_loss,
        "tok_s": result.tokens_per_s,
        "peak_gib": peak,
        "final": result.final_dir,
    }


def rounded_base(base: Path, out: Path, scaling: str) -> Path:
    """A copy of the model directory ``base`` whose decoder-layer projection weights are replaced
    by their float8 values (:func:`hone.kernels.fp8_linear.quantize`, then dequantized to the
    weight's dtype): what a float8 frozen base multiplies, in bf16."""
    from safetensors.torch import load_file, save_file

    from hone.kernels.fp8_linear import dequantize, quantize

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out)
    for shard in out.glob("*.safetensors"):
        tensors = load_file(str(shard))
        for name, t in tensors.items():
            if ".layers." in name and name.endswith("proj.weight") and t.dim() == 2:
                tensors[name] = dequantize(*quantize(t, scaling)).to(t.dtype)  # type: ignore[arg-type]
        save_file(tensors, str(shard), metadata={"format": "pt"})
    return out


def _parse_mode(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or not rest:
        raise SystemExit(f"--mode {text!r}: expected NAME=key=value[,key=value...]")
    return name, rest.split(",")


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="LoRA steps per mode")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="full bf16 steps that make the base (0: random preset)")
    parser.add_argument("--mode", action="append", default=[], help="extra mode: NAME=key=value[,key=value...]")
    parser.add_argument("--set", action="append", default=[], dest="overrides", help="key=value for every LoRA run")
    parser.add_argument("--only", nargs="*", help="run only these modes (bf16 always runs: it is the reference)")
    parser.add_argument("--out", type=Path, default=Path("runs/quant-convergence"))
    parser.add_argument("--seed", type=int, nargs="+", default=[0], help="one or more seeds (each its own base)")
    parser.add_argument(
        "--hidden", type=int, default=1024, help="width of the small Qwen3 (a multiple of 512; 512 puts NF4 at +2.5%%)"
    )
    parser.add_argument("--layers", type=int, default=8, help="its decoder layers")
    parser.add_argument(
        "--rounded-base", choices=["rowwise", "tensorwise"], help="add bf16 LoRA on the base's float8-rounded weights"
    )
    args = parser.parse_args()
    if args.hidden % 512:
        raise SystemExit(f"--hidden {args.hidden}: must be a multiple of 512 (NF4 groups of 16,384 weights)")
    if args.rounded_base and args.pretrain_steps <= 0:
        raise SystemExit("--rounded-base needs a pretrained base (--pretrain-steps > 0)")
    return args


def _one_seed(args: argparse.Namespace, seed: int, modes: dict[str, list[str]], out: Path) -> dict[str, dict[str, Any]]:
    """Every mode's run from one seed's base; prints that seed's table and returns its results."""
    shape = small_model(args.hidden, args.layers)
    modes = dict(modes)
    out.mkdir(parents=True, exist_ok=True)
    raw = _raw(out, args.steps, seed, shape)
    base_note = "random preset, head trained in full"
    if args.pretrain_steps > 0:
        pre_raw = _raw(out, args.pretrain_steps, seed, shape)
        pre_raw["adapter"] = {"type": "none"}
        pre_raw["optimizer"]["learning_rate"] = 2e-3
        print(f"seed {seed}: pretraining the base: {args.pretrain_steps} full bf16 steps ...", flush=True)
        pre = _run(pre_raw, [], out / "base")
        raw["model"] = {"path": str(pre["final"]), "dtype": "bfloat16"}
        base_note = f"base: {args.pretrain_steps} full bf16 steps from random (eval loss {pre['eval']:.4f})"
        if args.rounded_base:
            rounded = rounded_base(Path(pre["final"]), out / f"base-rounded-{args.rounded_base}", args.rounded_base)
            modes[f"bf16-rounded-{args.rounded_base}"] = [f"model.path={rounded}"]
    else:
        raw["adapter"]["lora_modules_to_save"] = ["lm_head"]
        raw["model"]["preset_overrides"] = {**shape, "tie_word_embeddings": False}

    results = {}
    for name, overrides in modes.items():
        print(f"seed {seed}, mode {name}: {args.steps} LoRA steps {overrides} ...", flush=True)
        try:
            results[name] = {**_run(raw, [*overrides, *args.overrides], out / name), "overrides": overrides}
        except Exception as exc:  # noqa: BLE001 - a row, not the end of the run
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}", "overrides": overrides}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        f"\n{device}; small Qwen3 hidden {args.hidden}, {args.layers} layers; seed {seed}; {base_note}; "
        f"LoRA r32 all-linear, {args.steps} steps, seq 256, micro-batch 16; --set {args.overrides or '-'}\n"
    )
    _print_seed_table(results)
    return results


def _relative(value: float, ref: float | None) -> float | None:
    return 100 * (value - ref) / ref if ref else None


def _percent(rel: float | None) -> str:
    return "-" if rel is None else f"{rel:+.2f}%"


def _print_seed_table(results: dict[str, dict[str, Any]]) -> None:
    ref, ref_train = (results.get("bf16", {}).get(key) for key in ("eval", "train_end"))
    print("| mode | overrides | final eval loss | rel. diff vs bf16 | train loss, last 30 steps | rel. diff | tok/s | peak GiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        shown = ", ".join(r["overrides"]) or "-"
        if "error" in r:
            print(f"| {name} | {shown} | error: {r['error']} | | | | | |")
            continue
        rel, rel_train = _relative(r["eval"], ref), _relative(r["train_end"], ref_train)
        print(
            f"| {name} | {shown} | {r['eval']:.4f} | {_percent(rel)} | {r['train_end']:.4f} | "
            f"{_percent(rel_train)} | {r['tok_s']:.0f} | {r['peak_gib']:.2f} |"
        )


def _print_summary(by_seed: dict[int, dict[str, dict[str, Any]]]) -> None:
    """Across seeds, each mode's relative difference from the same seed's bf16: the mean and the
    range, since one run's difference is within the spread between runs (about +-1-2%)."""
    print(f"\nAcross seeds {', '.join(map(str, by_seed))}: relative difference from the same seed's bf16\n")
    print("| mode | final eval loss: mean | range | train loss, last 30 steps: mean | range |")
    print("|---|---:|---|---:|---|")
    names = [name for name in next(iter(by_seed.values())) if name != "bf16"]
    for name in names:
        columns = []
        for key in ("eval", "train_end"):
            diffs = [
                _relative(results[name][key], results["bf16"].get(key))
                for results in by_seed.values()
                if name in results and "error" not in results[name] and "error" not in results["bf16"]
            ]
            diffs = [d for d in diffs if d is not None]
            if not diffs:
                columns += ["-", "-"]
                continue
            columns += [f"{sum(diffs) / len(diffs):+.2f}%", f"{min(diffs):+.2f}% .. {max(diffs):+.2f}%"]
        print(f"| {name} | {' | '.join(columns)} |")


def main() -> None:
    args = _arguments()
    modes = dict(BUILTIN_MODES)
    modes.update(_parse_mode(m) for m in args.mode)
    if args.only:
        modes = {k: v for k, v in modes.items() if k == "bf16" or k in args.only}
    several = len(args.seed) > 1
    by_seed = {seed: _one_seed(args, seed, modes, args.out / f"seed-{seed}" if several else args.out) for seed in args.seed}
    if several:
        _print_summary(by_seed)


if __name__ == "__main__":
    main()
