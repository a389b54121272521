"""Run a function on N CPU processes joined by gloo, as torchrun would start them.

Each process gets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (so :func:`hone.train.distributed.world_from_env`
sees the world), joins the process group, runs ``fn(rank, *args)``, and leaves the group.
Results come back through files the function writes (``torch.save`` under a tmp dir).

The processes fork from a forkserver that imported torch, transformers, PEFT and hone once for
the whole session: a fresh process per call as before (no state from the tests or from the
previous call), without paying a second or two of imports per rank per test.
"""

import multiprocessing
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    from hone.train.distributed import close_world, init_world

    init_world("cpu")
    try:
        fn(rank, *args)
    finally:
        if dist.is_initialized():
            dist.barrier()
        close_world()


#: What every call's processes import anyway (the forkserver imports them once, at its start).
PRELOAD = ["torch.distributed.fsdp", "transformers", "peft", "hone.testing", "hone.train.run", "fsdp_harness"]


def start(fn, world_size: int, *args) -> mp.ProcessContext:
    """Start ``fn(rank, *args)`` on ``world_size`` gloo processes and return at once: the caller
    joins them (``context.join``) or kills them (``context.processes``; a run killed mid-training)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call
    return mp.start_processes(
        _worker, args=(world_size, free_port(), fn, args), nprocs=world_size, join=False, start_method="forkserver"
    )


def spawn(fn, world_size: int, *args, timeout_s: float | None = None) -> None:
    """Run ``fn(rank, *args)`` on ``world_size`` gloo processes; raises if any of them fails, or
    kills them all and raises ``TimeoutError`` once they have run ``timeout_s`` (a hang)."""
    context = start(fn, world_size, *args)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if deadline is not None and time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{fn.__name__} on {world_size} processes still ran after {timeout_s} s")


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter or gradient, on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu().clone()


def save(obj, path: Path) -> None:
    torch.save(obj, Path(path))


def load_sharded_as_planned(cfg):
    """``(loaded, plan, facts)``: ``cfg``'s model loaded by the FSDP2 sharded loader on this rank's
    CPU (``loaded.model``), its base and adapted stages applied by the plan as ``hone train`` does."""
    from hone.models.sharded_load import load_model_sharded
    from hone.models.tokenizer import load_tokenizer
    from hone.runtime.world import world_from_env
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    facts = RunFacts(torch.device("cpu"), world=world_from_env())
    plan = plan_optimizations(cfg, facts)
    loaded = load_model_sharded(
        cfg,
        load_tokenizer(cfg.model),
        facts.device,
        shard=lambda m: plan.apply(m, "adapted", cfg, facts),
        before_adapter=lambda base: plan.apply(base, "base", cfg, facts),
    )
    return loaded, plan, facts
