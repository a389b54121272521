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
