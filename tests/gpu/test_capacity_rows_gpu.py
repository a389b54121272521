"""The capacity-row kernels of expert parallelism at its shapes on the GPU, against their float32
references on the counted rows: the gated activation (qwen3-moe's 768-wide experts at 4 ranks,
131,072 capacity rows of which a quarter real; gpt-oss's 2,880) and the scaled row gather of the
weighted pairs' backward (hidden 2,048), bf16 and float32."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from gated_rows_checks import kernel_errors  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(
    "layout,inter,rows,count",
    [("qwen", 768, 131_072, 32_768), ("qwen", 768, 65_536, 65_536), ("gptoss", 2_880, 16_384, 9_001)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_the_reference_at_expert_parallel_shapes(layout, inter, rows, count, dtype):
    errors = kernel_errors(layout, dtype, rows, inter, count, seed=rows + count, device="cuda")
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert errors["out"] <= tolerance and errors["grad"] <= tolerance, errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_rows_equal_the_reference_at_expert_parallel_shapes(dtype):
    """The weighted pairs' backward at qwen3-moe's hidden 2,048: 16,384 received tokens, 131,072 capacity rows."""
    from scaled_rows_checks import kernel_error

    assert kernel_error(dtype, 16_384, 131_072, 2_048, 40_000, seed=5, device="cuda") <= (
        1e-6 if dtype == torch.float32 else 1e-2
    )
