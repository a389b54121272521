"""The scaled row gather over a buffer's first rows (hone.kernels.scaled_rows): the Triton kernel
against the reference on the rows below the count (float32 exact to 1e-6, bf16 to its rounding),
the count at 0, mid-block, a block's edge and every row, indices reading the zero row past the
source; opcheck. Kernel cases run under Triton's interpreter in another process
(tests/kernels/scaled_rows_checks.py), skipped without triton; tests/gpu covers the GPU."""

from pathlib import Path

import torch
from interpreted import needs_triton, run_interpreted

from hone.kernels.scaled_rows import scaled_rows, scaled_rows_reference

CHECKS = Path(__file__).with_name("scaled_rows_checks.py")


@needs_triton
def test_kernel_equals_the_reference_on_the_counted_rows():
    errors = run_interpreted([str(CHECKS), "kernel"])
    assert len(errors) == 8
    for case, err in errors.items():
        assert err <= (1e-6 if "float32" in case else 1e-2), (case, err)


@needs_triton
def test_op_passes_opcheck():
    assert run_interpreted([str(CHECKS), "opcheck"]) == {"scaled_rows": "ok"}


def test_reference_scales_each_row_and_the_index_past_the_source_reads_zero():
    source = torch.randn(3, 4)
    index, scale = torch.tensor([2, 3, 0]), torch.tensor([0.5, 7.0, -1.0])
    out = scaled_rows_reference(source, index, scale, torch.tensor([3]), torch.float32)
    torch.testing.assert_close(out, torch.stack([0.5 * source[2], torch.zeros(4), -source[0]]))
    # without the interpreter the op is the reference on every row
    torch.testing.assert_close(scaled_rows(source, index, scale, torch.tensor([1]), torch.float32), out)
