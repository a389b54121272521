"""The ``reference: trl-dpo`` condition: TRL's DPOTrainer on the ``data: pairs`` workload.

The peer script benchmarks/peer/trl_dpo.py is the one implementation (it also runs on its own,
without hone, as the peer protocol asks); this module loads it from the repository checkout and
runs it in the bench worker's process with hone's model config, the workload's pairs and LoRA,
and the condition's checkpointing / compile / precomputed-reference settings, so its row lands
in the same table as hone's, measured by the same worker (step times, peak memory).
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from hone.bench.spec import BenchSpec, Condition
from hone.errors import HoneError

PEER = Path(__file__).resolve().parents[2] / "benchmarks" / "peer" / "trl_dpo.py"


def load_peer(path: Path = PEER) -> ModuleType:
    """The peer script as a module; a clear error where hone runs from an install without it."""
    if not path.is_file():
        raise HoneError(
            f"bench condition reference: trl-dpo runs the peer script {path}, which is not there: "
            "run hone bench from a checkout of the hone repository"
        )
    spec = importlib.util.spec_from_file_location("hone_bench_trl_dpo_peer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peer_args(peer: ModuleType, spec: BenchSpec, condition: Condition, device: torch.device) -> argparse.Namespace:
    """The peer's command-line settings for this workload and condition."""
    w = spec.workload
    argv = [
        "--prompt-len", str(w.prompt_len), "--completion-len", str(w.completion_len),
        "--mbs", str(w.micro_batch_size), "--accum", str(w.gradient_accumulation_steps),
        "--steps", str(spec.timed_steps), "--warmup", str(spec.warmup_steps),
        "--gc", str(int(condition.gradient_checkpointing)), "--compile", str(int(condition.compile)),
        "--precompute-ref", str(int(condition.precompute_ref)), "--loss", "ipo" if w.objective == "ipo" else "sigmoid",
        "--rank", str(w.adapter.lora_r), "--alpha", str(w.adapter.lora_alpha),
        "--targets", ",".join(w.adapter.lora_target_modules),
        "--cpu", str(int(device.type == "cpu")), "--dtype", w.dtype if w.dtype in ("bfloat16", "float32") else "auto",
    ]  # fmt: skip
    return peer.parse_args(argv)


def run_trl_dpo(
    config: Any, spec: BenchSpec, condition: Condition, device: torch.device, on_step: Callable[[int, float, Any], None]
) -> None:
    """Train the workload's steps with TRL; ``on_step(step, seconds, loss)`` after each (the loss
    is known at the last step only, None before)."""
    try:
        import trl  # noqa: F401 - the peer imports it; say what is missing before a model is built
    except ImportError:
        raise HoneError("bench condition reference: trl-dpo needs the Python package 'trl': pip install 'hone[dev]'") from None
    peer = load_peer()
    peer.run_dpo(config, peer_args(peer, spec, condition, device), on_step)
