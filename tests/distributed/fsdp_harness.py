"""Run a function on N CPU processes joined by gloo, as torchrun would start them.

Each process gets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (so :func:`hone.train.distributed.world_from_env`
sees the world), joins the process group, runs ``fn(rank, *args)``, and leaves the group.
Results come back through files the function writes (``torch.save`` under a tmp dir).
"""

import os
import socket
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


def spawn(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, *args)`` on ``world_size`` gloo processes; raises if any of them fails."""
    mp.spawn(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter or gradient, on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu().clone()


def save(obj, path: Path) -> None:
    torch.save(obj, Path(path))
