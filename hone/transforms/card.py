"""The memory a plan is made for: the card's size from ``--gpu-memory``, the local CUDA device
or a default, as ``hone plan``, the planner's ``auto`` decisions and the bench's estimate read it.

Apart from the report (:mod:`hone.transforms.plan_report`) so that the decisions below it
(:mod:`hone.transforms.auto_policy`, the estimate) can read the card without importing the
report that prints them.
"""

import os
from typing import Any

from hone.errors import HoneError
from hone.units import GIB, gib, parse_bytes

#: The card assumed when none is named and no CUDA device is visible (an H100/A100 80GB).
DEFAULT_GPU_MEMORY = 80 * GIB


class PlanInputError(HoneError):
    """A ``hone plan`` argument that cannot be used."""


class CardMemoryError(HoneError):
    """``memory.gpu_memory`` asks for more memory than the GPU has."""


def parse_size(text: str, flag: str = "--gpu-memory") -> int:
    """Bytes in ``text`` (:func:`hone.units.parse_bytes`), refused as a plan input naming ``flag``."""
    try:
        return parse_bytes(text, flag)
    except ValueError as e:
        raise PlanInputError(str(e)) from None


def device_memory(device: str, requested: str | None, configured: int | None = None) -> tuple[int, str]:
    """(bytes, where the number comes from): ``--gpu-memory``, else the config's
    ``memory.gpu_memory`` (``configured``, for a CUDA plan), else the local CUDA device's total
    memory, else the default 80 GiB card (CPU plans: the machine's RAM)."""
    if requested is not None:
        return parse_size(requested), "--gpu-memory"
    if configured is not None and device != "cpu":
        return configured, "memory.gpu_memory"
    if device == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
        except (ValueError, OSError, AttributeError):
            return DEFAULT_GPU_MEMORY, "default (RAM size unknown)"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"cuda:0, {props.name}"
    return DEFAULT_GPU_MEMORY, "no CUDA device here: an 80 GiB card (--gpu-memory to plan for another)"


def host_memory(requested: str | None) -> tuple[int, str]:
    """(bytes, where the number comes from) of the host memory a plan may use for offloaded
    layer inputs (pinned) and the process itself: ``--host-memory``, else this machine's RAM.
    Plan on a laptop for a GPU machine with ``--host-memory`` (e.g. 128GiB)."""
    if requested is not None:
        return parse_size(requested, "--host-memory"), "--host-memory"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
    except (ValueError, OSError, AttributeError):
        return 128 * GIB, "default 128 GiB (RAM size unknown)"


def cap_process_memory(limit: int | None, device: Any) -> str | None:
    """Hold this process's allocations on ``device`` to ``limit`` bytes (``memory.gpu_memory``),
    as a card of that size would: torch's per-process memory fraction, so an allocation past it
    fails with the out-of-memory error the smaller card gives. What it did, for the run log;
    None where there is nothing to cap (``auto``, or not a CUDA device)."""
    if limit is None or getattr(device, "type", None) != "cuda":
        return None
    import torch

    props = torch.cuda.get_device_properties(device)
    if limit > props.total_memory:
        raise CardMemoryError(
            f"memory.gpu_memory: {gib(limit)} is more than {props.name} has ({gib(props.total_memory)}); "
            "allowed: a size up to the card's memory, or auto (the card's own)"
        )
    # torch wants the card's index; a one-process run's device is plain ``cuda`` (the current card)
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(limit / props.total_memory, index)
    return f"memory.gpu_memory: allocations capped at {gib(limit)} of {props.name}'s {gib(props.total_memory)}"
