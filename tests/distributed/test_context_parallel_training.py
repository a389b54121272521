"""Exact context parallelism in training: ``hone train`` on 2 gloo processes with
``distributed.context_parallel: 2`` (each sequence split in two, attention exchanging heads for
tokens) gives one process's losses, gradient norms, eval losses and final weights (fp32, 1e-5):
a tiny Qwen3 with LoRA on attention, padded rows (odd widths: padded to a multiple of 2) and
packed rows, and a full fine-tune. Slow: 2 context-parallel groups x 2 data-parallel replicas on
4 processes against one process with accumulation 2."""

import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from dist_launch import hone_train_forked
from safetensors.torch import load_file

from hone.track.metrics import read_metrics

SEED = random.randrange(10_000)  # fresh each session (printed on failure)
STEPS = 3


def _config(out: Path, name: str, *, packed: bool, adapter: str, context_parallel: int, accumulation: int = 1) -> Path:
    data = out / "data.jsonl"
    if not data.exists():
        rng = random.Random(SEED)
        rows = [{"input_ids": [rng.randint(5, 250) for _ in range(rng.randint(7, 45))]} for _ in range(40)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    adapter_cfg = (
        {"type": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
        if adapter == "lora"
        else {"type": "full"}
    )
    cfg = {
        "model": {"preset": "tiny-qwen3", "dtype": "float32"},
        "data": {
            "datasets": [{"path": str(data), "type": "pretokenized"}],
            "sequence_len": 64,
            "sample_packing": packed,
            "val_set_size": 0.1,
            "dataset_prepared_path": str(out / "cache"),
        },
        "adapter": adapter_cfg,
        "training": {
            "max_steps": STEPS,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": accumulation,
            "eval_steps": 2,
            "max_grad_norm": 0.05,  # small: every step clips, so each rank's norm must be the global one
            "output_dir": str(out / name),
            "seed": SEED,
        },
        "optimizer": {"learning_rate": 5e-3},
        "distributed": {"context_parallel": context_parallel},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
    }
    path = out / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _metrics(run: Path) -> tuple[list[float], list[float]]:
    rows = read_metrics(run / "metrics.jsonl")
    train = [x for r in rows if "loss" in r for x in (r["loss"], r["grad_norm"])]
    return train, [r["eval_loss"] for r in rows if "eval_loss" in r]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    files = sorted((run / "final").glob("*.safetensors"))
    assert files, f"no weights in {run / 'final'}"
    return {k: v for f in files for k, v in load_file(f).items()}


def _assert_same(got: Path, expected: Path) -> None:
    ref_train, ref_eval = _metrics(expected)
    cp_train, cp_eval = _metrics(got)
    assert len(cp_train) == len(ref_train) == 2 * STEPS and len(cp_eval) == len(ref_eval) >= 2
    assert cp_train == pytest.approx(ref_train, rel=1e-5), f"seed {SEED}"
    assert cp_eval == pytest.approx(ref_eval, rel=1e-5), f"seed {SEED}"
    ref, cp = _weights(expected), _weights(got)
    assert cp.keys() == ref.keys() and ref
    for key, weight in ref.items():
        # 1e-5 absolute: AdamW divides by sqrt(v), which turns the rounding of a different
        # summation order in near-zero gradients into ~1e-6 of weight
        torch.testing.assert_close(cp[key], weight, rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key} (seed {SEED}): {m}")
    record = json.loads((got / "optimizations.json").read_text())
    assert "context_parallel" in [a["name"] for a in record["applied"]]


CASES = [("lora", False), ("lora", True), ("full", True)]


@pytest.mark.parametrize(("adapter", "packed"), CASES, ids=[f"{a}-{'packed' if p else 'padded'}" for a, p in CASES])
def test_two_ranks_splitting_each_sequence_equal_one_process(tmp_path, adapter, packed):
    kind = dict(packed=packed, adapter=adapter)
    hone_train_forked(_config(tmp_path, "one", context_parallel=1, **kind), processes=1)
    hone_train_forked(_config(tmp_path, "cp2", context_parallel=2, **kind), processes=2)
    _assert_same(tmp_path / "cp2", tmp_path / "one")


@pytest.mark.slow
def test_two_context_parallel_groups_of_two_equal_one_process_with_twice_the_accumulation(tmp_path):
    kind = dict(packed=True, adapter="lora")
    hone_train_forked(_config(tmp_path, "one", context_parallel=1, accumulation=2, **kind), processes=1)
    hone_train_forked(_config(tmp_path, "cp2x2", context_parallel=2, **kind), processes=4)
    _assert_same(tmp_path / "cp2x2", tmp_path / "one")
