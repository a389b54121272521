"""Big presets are drawn on the GPU in their dtype: building one allocates its bf16 weights
once (no float32 draft, no second copy). gpt-oss-20b is ~42 GB of bf16 weights; the peak of
building it must stay within 10% of that (transient init buffers). Skipped without a GPU (or one smaller than 60 GB)."""

import pytest
import torch

from hone.config.model import ModelConfig
from hone.models.loader import build_preset_model
from hone.testing import tiny_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 60 * 2**30, reason="needs a 60+ GB GPU"
)
def test_gpt_oss_20b_preset_peaks_at_its_bf16_weights():
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = build_preset_model(ModelConfig(preset="gpt-oss-20b"), tiny_tokenizer(), torch.device("cuda"), torch.bfloat16, seed=0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    peak = torch.cuda.max_memory_allocated() - before
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert weights > 40e9
    assert peak <= 1.10 * (weights + buffers), (peak / 2**30, weights / 2**30)  # a float32 draft or a copy: >= 2x
    del model
    torch.cuda.empty_cache()
