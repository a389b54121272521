"""The process groups of expert parallelism over ``N`` of a job's ``W`` ranks, and the reduction
of the expert blocks' gradients over their replicas.

With ``distributed.expert_parallel: N`` and ``W`` processes (``N`` divides ``W``), the ranks form
``W / N`` *expert-parallel groups* of ``N`` consecutive ranks (``{0..N-1}, {N..2N-1}, ...``): within
one, each rank holds one contiguous block of every MoE layer's experts (its position in the group
decides which) and tokens travel only between its members. The ranks at the same position of
every group hold the same block: a *replica group* (``{p, p+N, p+2N, ...}``). A block's gradient
on one rank then holds only its own group's tokens, so it is summed over its replica group once
per optimizer step (:func:`sum_over_replicas`), as DDP sums every other gradient over all ranks.
Consecutive ranks for the exchange: on several hosts of ``G`` GPUs with ``N <= G`` the all-to-all
stays within a host (NVLink), and only the replica sums cross hosts, once per step.

``N == W``: one group of every rank, which is the default group (``group`` None), and no replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["BUCKET_BYTES", "ExpertGroups", "context_group", "expert_groups", "group_layout", "sum_over_replicas"]

#: The most bytes of gradients one replica all-reduce moves through a flat buffer (larger
#: gradients are reduced in place, alone): few collectives, and little memory beside the gradients.
BUCKET_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel group and replica group (None: the default group / none)."""

    size: int  # N: ranks in an expert-parallel group
    world: int  # W: ranks in the job
    rank: int  # this rank's position in its expert-parallel group: which block of experts it holds
    group: dist.ProcessGroup | None = None  # None: the default group (N == W)
    replicas: dist.ProcessGroup | None = None  # None: no replicas (N == W)

    @property
    def replica_count(self) -> int:
        return self.world // self.size


def group_layout(world: int, size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the expert-parallel groups, the replica groups) of ``world`` ranks with ``size`` per
    expert-parallel group, as lists of ranks, in the order every rank creates them."""
    if size < 1 or world % size:
        raise ValueError(f"expert parallel size {size} does not divide the {world} ranks of the job")
    expert = [list(range(start, start + size)) for start in range(0, world, size)]
    replicas = [list(range(position, world, size)) for position in range(size)]
    return expert, replicas


_made: dict[int, tuple[object, ExpertGroups]] = {}  # size -> (the default group they belong to, the groups)


def expert_groups(size: int) -> ExpertGroups:
    """This rank's groups for ``size`` ranks per expert-parallel group (the process group must be
    initialised). Created once per default group: every rank must make its first call for a size
    at the same point (``dist.new_group`` is collective over the job: every rank creates every
    group, in the same order); later calls return the same groups."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size == world:
        return ExpertGroups(size, world, rank)
    default = dist.group.WORLD
    made = _made.get(size)
    if made is not None and made[0] is default:
        return made[1]
    expert, replicas = group_layout(world, size)
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, layout in (("group", expert), ("replicas", replicas)):
        for ranks in layout:
            created = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = created
    groups = ExpertGroups(size, world, rank % size, mine["group"], mine["replicas"])
    _made[size] = (default, groups)
    return groups


def sum_over_replicas(grads: list[torch.Tensor], replicas: dist.ProcessGroup | None) -> None:
    """Sum ``grads`` in place over the replica group (every rank of it calls this with the same
    tensors, in the same order): one all-reduce per bucket of up to :data:`BUCKET_BYTES` of one
    dtype and device, each gradient copied into a flat buffer and back (a larger or non-contiguous one alone)."""
    if replicas is None or not grads:
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[torch.dtype, torch.device], int] = {}  # bytes in each kind's last bucket
    for grad in grads:
        size = grad.numel() * grad.element_size()
        if size >= BUCKET_BYTES or not grad.is_contiguous():
            flat = grad.contiguous()
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=replicas)
            if flat is not grad:
                grad.copy_(flat)
            continue
        kind = (grad.dtype, grad.device)
        lists = buckets.setdefault(kind, [[]])
        if filled.get(kind, 0) + size > BUCKET_BYTES:
            lists.append([])
            filled[kind] = 0
        lists[-1].append(grad)
        filled[kind] = filled.get(kind, 0) + size
    for bucket in (b for lists in buckets.values() for b in lists if b):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=replicas)
        for grad, part in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
            grad.copy_(part.view_as(grad))


_context_made: dict[int, tuple[object, tuple[int, dist.ProcessGroup | None]]] = {}  # size -> (default group, mine)


def context_group(size: int) -> tuple[int, dist.ProcessGroup | None]:
    """(this rank's position in its context-parallel group, the group) for ``size`` consecutive
    ranks per group (``{0..N-1}, {N..2N-1}, ...``: on one host the exchanges stay on NVLink); the
    group is None (the default group) where ``size`` is the world size. Created once per default
    group: every rank makes its first call for a size at the same point (``dist.new_group`` is
    collective over the job)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"context parallel size {size} does not divide the {world} ranks of the job")
    if size == world:
        return rank, None
    default = dist.group.WORLD
    made = _context_made.get(size)
    if made is not None and made[0] is default:
        return made[1]
    mine = None
    for start in range(0, world, size):
        created = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = created
    _context_made[size] = (default, (rank % size, mine))
    return rank % size, mine
