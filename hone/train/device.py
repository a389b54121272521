"""Where training runs, and how much memory it has used there."""

import resource
import sys
from typing import NamedTuple

import torch

from hone.errors import HoneError


class DeviceError(HoneError):
    """A ``--device`` value that names no device of this machine."""


def checked_device(value: str, flag: str = "--device", cuda_count: int | None = None) -> torch.device:
    """``value`` as a device of this machine, or :class:`DeviceError` naming the flag, the value
    and what this machine has. Checked before anything loads: torch would accept ``cuda`` on a
    machine without a GPU and fail deep inside the model load, and ``gpu`` with a traceback.
    ``cuda_count`` (tests): the number of CUDA devices, else asked from torch."""
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    have = available_devices(cuda_count)
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"{flag} '{value}' is not a device hone runs on: use one of {have}")
    if device.type == "cuda" and cuda_count == 0:
        raise DeviceError(f"{flag} '{value}': this machine has no CUDA GPU that torch can use: use {have}")
    if device.type == "cuda" and device.index is not None and device.index >= cuda_count:
        raise DeviceError(
            f"{flag} '{value}': this machine has {cuda_count} CUDA GPU(s) visible (after CUDA_VISIBLE_DEVICES): use one of {have}"
        )
    if device.type == "mps" and not (torch.backends.mps.is_available()):
        raise DeviceError(f"{flag} '{value}': Apple's MPS is not available on this machine: use {have}")
    return device


def available_devices(cuda_count: int) -> str:
    """What ``--device`` may be on this machine, for messages."""
    names = ["cpu"]
    if cuda_count:
        names += ["cuda", *(f"cuda:{i}" for i in range(min(cuda_count, 8)))]
        if cuda_count > 8:
            names.append(f"... cuda:{cuda_count - 1}")
    if torch.backends.mps.is_available():
        names.append("mps")
    return ", ".join(names)


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """The caller's device, else the current CUDA device, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def peak_memory_gib(device: torch.device) -> float | None:
    """Peak memory so far: CUDA tensors allocated on ``device``, or the process's peak RSS
    on CPU (the closest CPU analogue; it includes Python and libraries, not only tensors)."""
    return memory_reading(device).peak_allocated_gib


class MemoryReading(NamedTuple):
    """What a step's end reads of the device's memory (see :func:`memory_reading`)."""

    peak_allocated_gib: float | None
    peak_reserved_gib: float | None
    alloc_retries: int | None


def memory_reading(device: torch.device) -> MemoryReading:
    """On a CUDA ``device``: the peak GiB allocated so far (tensors) and reserved (what the
    caching allocator holds for them: what ``nvidia-smi`` sees of the run), and how many times
    the allocator found the card full, freed its cache and retried (each retry waits for the
    device). On the CPU: the process's peak RSS, and None for the others (a CPU run has no
    allocator cache)."""
    if device.type == "cuda":
        # torch.cuda.max_memory_allocated / max_memory_reserved's numbers, read from the nested stats
        # without flattening and sorting all of them in Python: this runs after every step's sync,
        # while the device waits for the next step
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        allocated = stats.get("allocated_bytes", {}).get("all", {}).get("peak", 0)
        reserved = stats.get("reserved_bytes", {}).get("all", {}).get("peak", 0)
        return MemoryReading(allocated / 2**30, reserved / 2**30, int(stats.get("num_alloc_retries", 0)))
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (OSError, ValueError):
        return MemoryReading(None, None, None)
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return MemoryReading(peak * scale / 2**30, None, None)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a step's wall time covers its work (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
