"""Where training runs, and how much memory it has used there."""

import resource
import sys

import torch


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
    if device.type == "cuda":
        # torch.cuda.max_memory_allocated's number ("allocated_bytes.all.peak" of memory_stats), read
        # from the nested stats without flattening and sorting all of them in Python: this runs after
        # every step's sync, while the device waits for the next step
        allocated = torch.cuda.memory_stats_as_nested_dict(device).get("allocated_bytes", {})
        return allocated.get("all", {}).get("peak", 0) / 2**30
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (OSError, ValueError):
        return None
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return peak * scale / 2**30


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a step's wall time covers its work (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
