"""The processes of one run: who this one is, and the process group they share.

``torchrun`` (or ``hone train --nproc-per-node N``, which starts it) gives every process its
``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; a plain ``hone train`` is a world of one and never
touches ``torch.distributed``. Everything that differs between ranks asks the :class:`World`
(which data rows, whether to log and write), so the single-process path stays the same code.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """This process's place among the run's processes (a world of one when not launched by torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, plots, writes metrics and the final outputs."""
        return self.rank == 0


SINGLE = World()


def world_from_env() -> World:
    """The world ``torchrun`` describes in the environment; a world of one without it."""
    if "WORLD_SIZE" not in os.environ:
        return SINGLE
    return World(
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def backend_for(device_type: str) -> str:
    """NCCL between GPUs, gloo between CPU processes (tests, and CPU-only machines)."""
    return "nccl" if device_type == "cuda" else "gloo"


def init_world(device_type: str) -> World:
    """Join the process group of a multi-process run (idempotent); a world of one does nothing.

    On CUDA each process takes the GPU of its local rank before the group starts, so NCCL and
    every later allocation land on that card.
    """
    world = world_from_env()
    if not world.distributed or dist.is_initialized():
        return world
    if device_type == "cuda":
        torch.cuda.set_device(world.local_rank)
    dist.init_process_group(backend=backend_for(device_type))
    return world


def close_world() -> None:
    """Leave the process group (at the end of a run, also after an error)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def device_of(world: World, device_type: str) -> torch.device:
    """The device this rank trains on: its local GPU, or the CPU."""
    if device_type == "cuda":
        return torch.device("cuda", world.local_rank)
    return torch.device(device_type)
