"""The process group of one run: checking the launch, joining and leaving the group, and
agreeing across ranks at each start-up phase (:func:`together`).

Who this process is among the run's (:class:`~hone.runtime.world.World`) is a contract the
transforms need too, so it lives in :mod:`hone.runtime.world`.
"""

import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hone.errors import HoneError
from hone.runtime.world import World, world_from_env

if TYPE_CHECKING:
    from hone.config.root import HoneConfig


class DistributedSetupError(HoneError):
    """The launch cannot work: more processes than devices, ``strategy: none`` on several, ..."""


class PeerFailed(HoneError):
    """Another rank of the run failed; this one stops too, with that rank's message.

    ``quiet``: the CLI prints nothing for it (the failing rank printed its own message, and rank 0
    repeats it once); its exit code is the failing rank's."""

    def __init__(self, message: str, exit_code: int = 2, quiet: bool = False) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.quiet = quiet


def local_world_size() -> int:
    """Processes on this host (torchrun's ``LOCAL_WORLD_SIZE``; the world size without it)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else world_from_env().world_size


def check_launch(cfg: "HoneConfig", world: World, device_type: str, local_processes: int | None = None) -> None:
    """Refuse, before any data or model loads, a launch that cannot work: raises
    :class:`DistributedSetupError` naming the key or flag, the value and what is allowed.
    ``local_processes``: processes on this host (default: torchrun's ``LOCAL_WORLD_SIZE``)."""
    problems = expert_parallel_problems(cfg, world) + context_parallel_launch_problems(cfg, world)
    if not world.distributed and not problems:
        return
    strategy = cfg.distributed.strategy
    if strategy == "none":
        problems.append(
            f"distributed.strategy: 'none' refuses to run on more than one process, and this run has "
            f"{world.world_size}: set distributed.strategy to auto, ddp or fsdp, or start one process"
        )
    if device_type == "cuda":
        visible = torch.cuda.device_count()
        wanted = local_processes if local_processes is not None else local_world_size()
        if wanted > visible:
            problems.append(
                f"--nproc-per-node {wanted} starts {wanted} processes on this host, but it has {visible} "
                f"visible CUDA device{'s' if visible != 1 else ''} (one per process): use at most {visible} "
                "(CUDA_VISIBLE_DEVICES limits which are visible)"
            )
    elif device_type != "cpu":
        problems.append(
            f"{world.world_size} processes on device '{device_type}': hone runs several processes on CUDA "
            "GPUs (NCCL) or on the CPU (gloo) only"
        )
    if problems:
        raise DistributedSetupError("cannot start this multi-process run:\n  - " + "\n  - ".join(problems))


def expert_parallel_problems(cfg: "HoneConfig", world: World) -> list[str]:
    """``distributed.expert_parallel`` against the launch: 1 (off), auto, or a divisor ``N > 1``
    of the job's processes (``W / N`` expert-parallel groups of ``N`` ranks, each block of
    experts held by ``W / N`` replicas: :mod:`hone.parallel.groups`)."""
    ep, size = cfg.distributed.expert_parallel, world.world_size
    if ep in (1, "auto") or (isinstance(ep, int) and ep > 1 and size % ep == 0):
        return []
    divisors = ", ".join(str(d) for d in range(2, size + 1) if size % d == 0) or "none"
    return [
        f"distributed.expert_parallel: {ep} on {size} process{'es' if size != 1 else ''}: N must divide the number of "
        f"processes (--nproc-per-node times the hosts: {size} here); divisors over 1: {divisors}; or 1 (off) or auto"
    ]


def context_parallel_launch_problems(cfg: "HoneConfig", world: World) -> list[str]:
    """``distributed.context_parallel`` against the launch: 1 (off), or a divisor ``N > 1`` of the
    job's processes (``W / N`` groups of ``N`` consecutive ranks, each group splitting its
    sequences; data parallelism over the groups), and the model's heads and attention (read from
    its config: nothing loads, no GPU is touched; the plan checks them again with the kernel it picks)."""
    cp, size = cfg.distributed.context_parallel, world.world_size
    if cp == 1:
        return []
    problems = _context_parallel_model_problems(cfg)
    if size % cp == 0:
        return problems
    divisors = ", ".join(str(d) for d in range(2, size + 1) if size % d == 0) or "none"
    return [
        f"distributed.context_parallel: {cp} on {size} process{'es' if size != 1 else ''}: N must divide the number of "
        f"processes (--nproc-per-node times the hosts: {size} here); divisors over 1: {divisors}; or 1 (off)",
        *problems,
    ]


def _context_parallel_model_problems(cfg: "HoneConfig") -> list[str]:
    from hone.models.attention.ulysses import context_parallel_problems
    from hone.transforms.memory.facts import transformers_config

    try:
        model_config = transformers_config(cfg.model)
    except Exception:  # noqa: BLE001 -- an unreadable model is reported where it loads
        return []
    asked = cfg.model.attn_implementation
    return context_parallel_problems(model_config, cfg.distributed.context_parallel, None if asked == "auto" else asked)


def _describe(exc: BaseException) -> tuple[str, int]:
    if isinstance(exc, HoneError):
        return str(exc), exc.exit_code
    text = str(exc).strip() or "(no message)"
    return f"{type(exc).__name__}: {text}", 1


def agree(world: World, failure: BaseException | None = None, payload: Any = None) -> list[Any]:
    """Every rank says whether it failed (and hands over ``payload``); returns every rank's
    payload, rank order. A rank that did not fail while another did raises :class:`PeerFailed`
    with the lowest failing rank's message (rank 0 prints it, the others stay quiet). Collective:
    every rank must call it at the same point; it doubles as a barrier."""
    if not world.distributed:
        return [payload]
    mine = (None, 0) if failure is None else _describe(failure)
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, (mine, payload))
    failed = [(rank, info) for rank, (info, _) in enumerate(gathered) if info[0] is not None]
    if failed and failure is None:
        rank, (message, code) = failed[0]
        raise PeerFailed(
            f"rank {rank} of {world.world_size} failed, so the run stopped: {message}", code, quiet=not world.is_main
        )
    return [p for _, p in gathered]


@contextmanager
def together(world: World) -> Iterator[None]:
    """Run a start-up phase on every rank and stop all of them if any one fails, with that rank's
    message (no rank is left waiting in a collective for one that is gone)."""
    try:
        yield
    except Exception as exc:
        agree(world, exc)
        raise
    agree(world)


def backend_for(device_type: str, cpu_collectives: bool = False) -> str:
    """NCCL between GPUs, gloo between CPU processes (tests, and CPU-only machines). With
    ``cpu_collectives`` a GPU run gets gloo beside NCCL for tensors that live on the host:
    FSDP2's CPU offload keeps the gradient shards there, and the global gradient norm reduces
    over them (NCCL alone has no CPU backend)."""
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"


def init_world(device_type: str, cpu_collectives: bool = False) -> World:
    """Join the process group of a multi-process run (idempotent); a world of one does nothing.

    On CUDA each process takes the GPU of its local rank before the group starts, so NCCL and
    every later allocation land on that card. ``cpu_collectives``: see :func:`backend_for`.
    """
    world = world_from_env()
    if not world.distributed or dist.is_initialized():
        return world
    if device_type == "cuda":
        torch.cuda.set_device(world.local_rank)
    dist.init_process_group(backend=backend_for(device_type, cpu_collectives))
    return world


def close_world() -> None:
    """Leave the process group (at the end of a run, also after an error)."""
    if dist.is_available() and dist.is_initialized():
        release_cuda_graphs()
        dist.destroy_process_group()


def release_cuda_graphs() -> None:
    """Drop the CUDA graphs Inductor recorded (``performance.cuda_graphs``), if any.

    A recorded graph that holds NCCL kernels (expert parallelism's exchanges inside each compiled
    layer) keeps its communicator in use, and ``destroy_process_group`` then waits for it forever
    (pytorch/pytorch#115388: measured, a finished 2-GPU run never exited). The graphs are only
    found where Inductor's CUDA-graph module was loaded; otherwise there is nothing to drop.
    """
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()
    trees.reset_cudagraph_trees()
    gc.collect()


def device_of(world: World, device_type: str) -> torch.device:
    """The device this rank trains on: its local GPU, or the CPU."""
    if device_type == "cuda":
        return torch.device("cuda", world.local_rank)
    return torch.device(device_type)
