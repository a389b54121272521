"""Launch checks and the data split, without starting processes."""

import argparse
from pathlib import Path

import pytest
import torch

from hone.cli import torchrun_command
from hone.config.training import TrainingConfig
from hone.runtime.world import World
from hone.testing import tiny_config
from hone.train.batches import BatchStream, plan_steps
from hone.train.distributed import DistributedSetupError, check_launch
from hone.transforms.base import RunFacts
from hone.transforms.data_parallel import resolve_strategy
from hone.transforms.planner import PlanError, decisions, plan_optimizations


@pytest.mark.parametrize(("world", "accumulation"), [(2, 1), (2, 3), (4, 2)])
def test_ranks_split_the_global_batch_of_one_process_with_world_times_the_accumulation(world, accumulation):
    rows, seed = 101, 5
    single = plan_steps(rows, TrainingConfig(micro_batch_size=2, gradient_accumulation_steps=world * accumulation, max_steps=9))
    shared = plan_steps(rows, TrainingConfig(micro_batch_size=2, gradient_accumulation_steps=accumulation, max_steps=9), world)
    assert (shared.steps_per_epoch, shared.total_steps, shared.rows_per_step) == (single.steps_per_epoch, 9, single.rows_per_step)
    one = BatchStream(single, seed)
    ranks = [BatchStream(shared, seed, rank=r) for r in range(world)]
    for _ in range(9):  # across an epoch boundary
        expected = one.next_window()
        windows = [stream.next_window() for stream in ranks]
        assert all(len(w) == accumulation for w in windows)
        assert [mb for w in windows for mb in w] == expected  # rank r: micro-batches r*k .. r*k+k-1
        assert all(stream.position == one.position for stream in ranks)


def test_too_little_data_for_the_global_batch_names_the_processes():
    with pytest.raises(Exception, match="x 4 processes = 8.*fewer processes"):
        plan_steps(6, TrainingConfig(micro_batch_size=2, gradient_accumulation_steps=1), 4)


def test_more_processes_than_gpus_and_strategy_none_are_refused(monkeypatch):
    cfg = tiny_config(Path("unused"), distributed={"strategy": "none"})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DistributedSetupError) as info:
        check_launch(cfg, World(0, 4, 0), "cuda", local_processes=4)
    text = str(info.value)
    assert "distributed.strategy: 'none'" in text and "4 processes" in text
    assert "--nproc-per-node 4" in text and "2 visible CUDA devices" in text
    check_launch(tiny_config(Path("unused")), World(0, 2, 0), "cuda", local_processes=2)  # fits
    check_launch(cfg, World(), "cuda")  # one process: nothing to refuse
    with pytest.raises(DistributedSetupError, match="'mps'"):
        check_launch(tiny_config(Path("unused")), World(0, 2, 0), "mps", local_processes=2)


def test_auto_strategy_says_which_and_why():
    cfg = tiny_config(Path("unused"))
    cpu = torch.device("cpu")
    assert resolve_strategy(cfg, RunFacts(cpu))[0] == "none"
    strategy, why = resolve_strategy(cfg, RunFacts(cpu, world=World(0, 2, 0)))
    assert strategy == "ddp" and "DDP" in why and "GiB" in why
    strategy, why = resolve_strategy(cfg, RunFacts(cpu, world=World(0, 2, 0), memory_bytes=1024))
    assert strategy == "fsdp" and "does not fit" in why
    on = {name: (chosen, reason) for name, _, chosen, reason in decisions(cfg, RunFacts(cpu, world=World(0, 2, 0)))}
    assert on["ddp"][0] and "DDP" in on["ddp"][1]
    assert not {name: c for name, _, c, _ in decisions(cfg, RunFacts(cpu))}["ddp"]


def test_a_world_with_no_data_parallel_transform_is_refused_by_the_plan():
    cfg = tiny_config(Path("unused"), distributed={"strategy": "none"})
    with pytest.raises(PlanError, match="distributed.strategy: none"):
        plan_optimizations(cfg, RunFacts(torch.device("cpu"), world=World(0, 2, 0)))


def test_the_launcher_runs_the_same_train_command_under_torchrun():
    args = argparse.Namespace(
        nproc_per_node=4, verbose=True, config=Path("cfg.yml"), overrides=["training.max_steps=3", "a.b=c d"]
    )
    command = torchrun_command(args)
    assert command[1:] == [
        "-m",
        "hone.train.torchrun",
        "--standalone",
        "--nproc-per-node=4",
        "-m",
        "hone",
        "--verbose",
        "train",
        "cfg.yml",
        "--set",
        "training.max_steps=3",
        "--set",
        "a.b=c d",
    ]
