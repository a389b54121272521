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
    return memory_peaks_gib(device)[0]


def memory_peaks_gib(device: torch.device) -> tuple[float | None, float | None]:
    """``(peak allocated, peak reserved)`` GiB so far on a CUDA ``device`` (tensors, and what the
    caching allocator holds for them: the second is what ``nvidia-smi`` sees of the run); on the
    CPU ``(peak RSS of the process, None)``: a CPU run has no allocator cache to report."""
    if device.type == "cuda":
        # torch.cuda.max_memory_allocated / max_memory_reserved's numbers, read from the nested stats
        # without flattening and sorting all of them in Python: this runs after every step's sync,
        # while the device waits for the next step
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        allocated = stats.get("allocated_bytes", {}).get("all", {}).get("peak", 0)
        reserved = stats.get("reserved_bytes", {}).get("all", {}).get("peak", 0)
        return allocated / 2**30, reserved / 2**30
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (OSError, ValueError):
        return None, None
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return peak * scale / 2**30, None


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a step's wall time covers its work (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
