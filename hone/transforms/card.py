"""The memory a plan is made for: the card's size from ``--gpu-memory``, the local CUDA device
or a default, as ``hone plan``, the planner's ``auto`` decisions and the bench's estimate read it.

Apart from the report (:mod:`hone.transforms.plan_report`) so that the decisions below it
(:mod:`hone.transforms.auto_policy`, the estimate) can read the card without importing the
report that prints them.
"""

import os
import re

from hone.errors import HoneError
from hone.units import GIB

#: The card assumed when none is named and no CUDA device is visible (an H100/A100 80GB).
DEFAULT_GPU_MEMORY = 80 * GIB

_UNITS = {
    "": GIB,  # a bare number is GiB
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


class PlanInputError(HoneError):
    """A ``hone plan`` argument that cannot be used."""


def parse_size(text: str, flag: str = "--gpu-memory") -> int:
    """Bytes in ``text``: ``80GiB``, ``24GB``, ``141 GiB``, ``81559MiB``, or a bare number of GiB."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise PlanInputError(
            f"{flag}: '{text}' is not a memory size; write a number with a unit, e.g. 80GiB, 24GB, "
            "141GiB or 81559MiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; a bare number is GiB)"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise PlanInputError(f"{flag}: '{text}' is not a positive memory size")
    return size


def device_memory(device: str, requested: str | None) -> tuple[int, str]:
    """(bytes, where the number comes from): ``--gpu-memory``, else the local CUDA device's
    total memory, else the default 80 GiB card (CPU plans: the machine's RAM)."""
    if requested is not None:
        return parse_size(requested), "--gpu-memory"
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
