"""The fsdp transform in the plan: when it is on, why, and what it refuses (no processes needed)."""

import pytest
import torch

from hone.runtime.world import World
from hone.transforms.base import RunFacts
from hone.transforms.planner import PlanError, decisions, plan_optimizations


def _cfg(**distributed):
    from pathlib import Path

    from hone.testing import tiny_config

    return tiny_config(Path("unused"), distributed=distributed)


def _facts(world_size: int, device: str = "cpu", memory: int | None = None) -> RunFacts:
    return RunFacts(torch.device(device), world=World(rank=0, world_size=world_size), memory_bytes=memory)


def test_fsdp_is_last_and_on_only_with_several_processes():
    assert "fsdp" not in plan_optimizations(_cfg(strategy="fsdp"), _facts(1)).names
    assert plan_optimizations(_cfg(strategy="fsdp"), _facts(2)).names[-1] == "fsdp"
    assert "fsdp" not in plan_optimizations(_cfg(strategy="ddp"), _facts(2)).names


def test_single_process_fsdp_says_why_it_is_skipped():
    plan = plan_optimizations(_cfg(strategy="fsdp"), _facts(1))
    assert any(s["name"] == "fsdp" and "single process" in s["reason"] for s in plan.skipped)


def test_auto_picks_fsdp_only_when_the_training_state_does_not_fit():
    roomy = {name: on for name, _, on, _ in decisions(_cfg(strategy="auto"), _facts(2, memory=80 * 2**30))}
    cramped = {name: on for name, _, on, _ in decisions(_cfg(strategy="auto"), _facts(2, memory=1024))}
    assert roomy["fsdp"] is False and cramped["fsdp"] is True


def test_float16_and_cpu_offload_on_cpu_are_refused():
    from pathlib import Path

    from hone.testing import tiny_config

    cfg = tiny_config(Path("unused"), model={"preset": "tiny-llama", "dtype": "float16"}, distributed={"strategy": "fsdp"})
    with pytest.raises(PlanError, match="model.dtype: float16 is not supported"):
        plan_optimizations(cfg, _facts(2))
    with pytest.raises(PlanError, match="cpu_offload: true offloads from a GPU"):
        plan_optimizations(_cfg(strategy="fsdp", cpu_offload=True), _facts(2))
