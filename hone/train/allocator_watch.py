"""Say when a run trains at the card's memory limit.

When an allocation fits neither the caching allocator's free blocks nor the card, torch frees
every cached block (a device synchronization) and retries; nothing is printed, and the step is
just slower. It happens where the peak sits within fragmentation's reach of the card: on two
H200s a process held to 42 GiB (``memory.gpu_memory``) whose peak was 39 GiB ran each step in
790 ms against 403 ms held to 80 GiB, with the same settings
(benchmarks/2026-11-29-h200x2-expert-parallel.md). The watch reads the allocator's retry count
(torch's ``num_alloc_retries``, read with the step's memory peaks) and warns once, after the
first step (which compiles, autotunes and grows the cache), with what leaves more room.
"""

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class RetryWatch:
    """``on_step`` after every optimizer step, with the allocator's retries so far (None off CUDA)."""

    warn: Callable[[str], None]
    after_first: int | None = None
    warned: bool = False

    def on_step(self, step: int, retries: int | None, peak_reserved_gib: float | None) -> None:
        if retries is None or self.warned:
            return
        if self.after_first is None:
            self.after_first = retries
            return
        if retries > self.after_first:
            self.warned = True
            held = f" (peak reserved {peak_reserved_gib:.1f} GiB)" if peak_reserved_gib is not None else ""
            self.warn(
                f"step {step}: the CUDA caching allocator found the card full {retries - self.after_first} time(s) "
                f"since the first step and freed its cache to retry{held}; each retry waits for the device, which "
                "can halve a step's speed. Leave room: more checkpointing (memory.activation_checkpointing, "
                "a lower memory.selective_memory_budget), memory.expandable_segments: true, or, where "
                "memory.gpu_memory holds the run below the card's size, a larger one. Later retries are counted "
                "in metrics.jsonl (alloc_retries), not warned about."
            )
