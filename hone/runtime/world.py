"""This process's place among the run's processes.

``torchrun`` (or ``hone train --nproc-per-node N``, which starts it) gives every process its
``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; a plain ``hone train`` is a world of one and never
touches ``torch.distributed``. Everything that differs between ranks asks the :class:`World`
(which data rows, whether to log and write), so the single-process path stays the same code.
Joining and leaving the process group is :mod:`hone.train.distributed`'s job.
"""

import os
from dataclasses import dataclass

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

    def data_parallel(self, context_parallel: int = 1) -> tuple[int, int]:
        """(this rank's data-parallel replica, the replicas): with context parallelism over ``N``
        consecutive ranks, the ``N`` ranks of a group read the same micro-batches and split each
        sequence, so the data is shared by ``world_size / N`` replicas (``N`` divides the world:
        the launch checks it)."""
        return self.rank // context_parallel, max(1, self.world_size // context_parallel)

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


def current_world() -> World:
    """The world of a process group already joined (by :func:`hone.train.distributed.init_world`);
    a world of one if none."""
    if dist.is_available() and dist.is_initialized():
        return World(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=world_from_env().local_rank)
    return SINGLE
