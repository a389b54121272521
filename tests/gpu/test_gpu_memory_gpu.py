"""``memory.gpu_memory`` on a real GPU: with the process capped at half the card, a tensor of
60% of the card fails to allocate (torch's out-of-memory error, as on a card that size), and one
of 40% does not.

Run: pytest -q -m gpu tests/gpu/test_gpu_memory_gpu.py
"""

import pytest
import torch

from hone.transforms.card import cap_process_memory

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("device", [torch.device("cuda", 0), torch.device("cuda")], ids=["cuda:0", "cuda"])
def test_a_capped_process_cannot_allocate_past_the_cap(device):
    # a one-process run's device is plain ``cuda``, which torch's cap refuses without an index
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    try:
        assert "capped at" in cap_process_memory(total // 2, device)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(total * 0.6), dtype=torch.uint8, device=device)
        fits = torch.empty(int(total * 0.4), dtype=torch.uint8, device=device)
        del fits
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


def test_an_allocation_that_needs_the_cache_freed_counts_as_a_retry():
    """The cached small blocks cannot serve a large block under the cap: the allocator frees its
    cache and retries, which :func:`hone.train.device.memory_reading` reports."""
    from hone.train.allocator_watch import RetryWatch
    from hone.train.device import memory_reading

    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    said: list[str] = []
    watch = RetryWatch(said.append)
    try:
        cap_process_memory(total // 2, device)
        before = memory_reading(device).alloc_retries
        watch.on_step(1, before, None)
        small = [torch.empty(int(total * 0.04), dtype=torch.uint8, device=device) for _ in range(10)]
        del small  # freed into the allocator's cache: 40% of the card held, none of it one block
        large = torch.empty(int(total * 0.3), dtype=torch.uint8, device=device)
        del large
        after = memory_reading(device).alloc_retries
        assert after > before
        watch.on_step(2, after, None)
        assert len(said) == 1 and "found the card full" in said[0]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
