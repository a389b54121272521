"""Exact data parallelism for a preference objective: DPO on 2 ranks (DDP or FSDP2, gloo) x 1
micro-batch of 2 pairs == 1 process x 2 micro-batches: the same losses and TRL metrics at every
step (the pair counts all-reduced with the tokens, the metrics with the loss), the same eval, the
same final LoRA weights, on both ranks. Under FSDP2 the reference pass (the adapter switched off)
runs inside the root unit's forward, before the policy's."""

import os
import random
from pathlib import Path

import pytest
import torch
from fsdp_harness import spawn
from rich.console import Console

from hone.runtime.world import SINGLE, World
from hone.testing import plan_hooks, tiny_config, tiny_llama, with_random_lora
from hone.track.metrics import read_metrics
from hone.train.loop import train_loop

SEED = int(os.environ.get("HONE_TEST_SEED", random.randrange(10_000)))  # fresh each session; fix it to reproduce
CPU = torch.device("cpu")


def _pairs(n: int, seed: int) -> list[dict[str, list[int]]]:
    gen = random.Random(seed)

    def ids(low: int, high: int) -> list[int]:
        return [gen.randrange(1, 97) for _ in range(gen.randint(low, high))]

    return [{"prompt_ids": ids(2, 9), "chosen_ids": ids(1, 8), "rejected_ids": ids(1, 8)} for _ in range(n)]


def _run(out: Path, seed: int, world: World, accumulation: int, strategy: str = "ddp", adapter: str = "lora") -> torch.nn.Module:
    torch.manual_seed(seed)  # PEFT draws LoRA's A matrices from the global generator
    model = tiny_llama(seed)
    if adapter == "lora":
        model = with_random_lora(model, seed)
    model.config._attn_implementation = "sdpa"
    cfg = tiny_config(
        out,
        adapter={"type": "lora", "lora_r": 4} if adapter == "lora" else {"type": "none"},
        data={"val_set_size": 0.1},
        training={
            "max_steps": 3,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": accumulation,
            "eval_steps": 3,
            "objective": "dpo",
            "preference": {"beta": 0.5},
        },
        optimizer={"learning_rate": 5e-3, "lr_scheduler": "constant", "weight_decay": 0.01, "fused": False},
        distributed={"strategy": strategy} if world.distributed else {},
    )
    if strategy == "fsdp" and world.distributed:  # shard the model as the run does, then its hooks
        from hone.transforms.base import RunFacts
        from hone.transforms.planner import plan_optimizations

        facts = RunFacts(CPU, world=world)
        plan = plan_optimizations(cfg, facts)
        assert "fsdp" in plan.names
        plan.apply(model, "adapted", cfg, facts)
        hooks = plan.hooks(model, cfg, facts)
    else:
        hooks = plan_hooks(model, cfg, CPU, world)
    train_loop(
        model,
        _pairs(24, seed),
        _pairs(5, seed + 1),
        cfg,
        device=CPU,
        pad_id=0,
        console=Console(quiet=True),
        world=world,
        hooks=hooks,
    )
    return model


def _trainable(model) -> dict[str, torch.Tensor]:
    from fsdp_harness import full

    return {n: full(p) for n, p in model.named_parameters() if p.requires_grad}


def _rank(rank: int, out: Path, seed: int, strategy: str, adapter: str) -> None:
    from hone.train.distributed import init_world

    model = _run(out, seed, init_world("cpu"), accumulation=1, strategy=strategy, adapter=adapter)
    torch.save(_trainable(model), out / f"weights-rank{rank}.pt")


def _reward_rounding(row: dict, key: str, beta: float = 0.5) -> float:
    """The absolute tolerance of a reward metric: rewards are beta x differences of summed
    log-probs, so their rounding scales with the log-probs, not with the small, cancelling
    difference (a random seed moved a margin of 0.0257 by 1.2e-6 between 2 ranks and 1)."""
    prefix = key[: -len("rewards/margins")]
    logps = [abs(row[f"{prefix}logps/{side}"]) for side in ("chosen", "rejected") if f"{prefix}logps/{side}" in row]
    return max(1e-6, 1e-5 * beta * max(logps, default=0.0))


@pytest.mark.parametrize("strategy, adapter", [("ddp", "lora"), ("fsdp", "lora"), ("ddp", "none"), ("fsdp", "none")])
def test_dpo_on_two_ranks_equals_one_rank_with_twice_the_accumulation(tmp_path, strategy, adapter):
    """``adapter: none``: the reference precomputed before the first step, each rank every second
    forward of the pass, then summed (under FSDP2 a rank with no forward left in the last round
    runs one it drops: the eval split's 3 micro-batches over 2 ranks)."""
    spawn(_rank, 2, tmp_path / "ddp", SEED, strategy, adapter, timeout_s=180)
    reference = _trainable(_run(tmp_path / "one", SEED, SINGLE, accumulation=2, adapter=adapter))
    assert (tmp_path / "ddp" / "reference_logps.safetensors").is_file() == (adapter == "none")
    two, one = read_metrics(tmp_path / "ddp" / "metrics.jsonl"), read_metrics(tmp_path / "one" / "metrics.jsonl")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [0, 1, 2, 3, 3]
    for a, b in zip(two, one, strict=True):
        for key in ("loss", "eval_loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "eval_rewards/margins"):
            if key in b:
                tolerance = _reward_rounding(b, key) if key.endswith("rewards/margins") else 1e-6
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=tolerance), (b["step"], key, f"seed {SEED}")
        assert a.get("eval_pairs") == b.get("eval_pairs")
    rank0 = torch.load(tmp_path / "ddp" / "weights-rank0.pt")
    rank1 = torch.load(tmp_path / "ddp" / "weights-rank1.pt")
    assert rank0.keys() == reference.keys() and len(reference) > 0
    for key, weight in reference.items():
        torch.testing.assert_close(rank1[key], rank0[key], rtol=0, atol=0, msg=f"replicas differ: {key}")
        torch.testing.assert_close(rank0[key], weight, rtol=1e-5, atol=1e-5, msg=f"{key} (seed {SEED})")


def _killed_config(tmp_path: Path, name: str) -> Path:
    import yaml

    sample = Path(__file__).resolve().parents[2] / "examples" / "data" / "preference_sample.jsonl"
    cfg = {
        "model": {"preset": "tiny-llama", "dtype": "float32"},
        "data": {
            "datasets": [{"path": str(sample), "type": "preference"}],
            "sequence_len": 64,
            "dataset_prepared_path": str(tmp_path / "cache"),
        },
        "adapter": {"type": "lora", "lora_r": 4},
        "training": {
            "objective": "dpo",
            "max_steps": 16,
            "save_steps": 4,
            "micro_batch_size": 2,
            "output_dir": str(tmp_path / name),
            "seed": 5,
        },
        "optimizer": {"learning_rate": 5e-3},
        "distributed": {"strategy": "ddp"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
    }
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.long  # two torchrun launches (~70 s on 2 cores); tests/integration/test_preference_run.py resumes a crash in-process
def test_a_killed_two_process_dpo_run_resumes_to_the_uninterrupted_losses(tmp_path):
    """``hone train --nproc-per-node 2`` of DPO, SIGKILLed once a checkpoint is complete, resumed
    with ``training.resume: latest`` (tests/distributed/killed_run.py, as for SFT)."""
    from dist_launch import child_env, hone_train_forked
    from killed_run import kill_and_resume

    done = kill_and_resume(
        _killed_config(tmp_path, "straight"),
        _killed_config(tmp_path, "killed"),
        child_env(),
        kill_after=4,
        timeout_s=300,
        straight=hone_train_forked,
    )
    rows = {name: [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in r] for name in ("straight", "killed")}
    want = {r["step"]: r for r in rows["straight"]}
    got = {r["step"]: r for r in rows["killed"]}
    after = list(range(done + 1, 17))
    assert after, "the kill came after the last step"
    for step in after:
        for key in ("loss", "rewards/margins", "logps/chosen"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5, abs=1e-6), (step, key)
