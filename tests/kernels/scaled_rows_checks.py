"""Checks of the scaled row gather over a buffer's first rows (hone.kernels.scaled_rows), one case per run.

Run as ``python tests/kernels/scaled_rows_checks.py CASE`` with ``TRITON_INTERPRET=1`` set (before
triton is imported: tests/interpreted.py's process, from tests/kernels/test_scaled_rows.py); prints
``RESULT {json}``. The GPU test imports :func:`kernel_error` too.
"""

from __future__ import annotations

import json
import sys

import torch

from hone.kernels.scaled_rows import scaled_rows, scaled_rows_reference


def kernel_error(dtype: torch.dtype, sources: int, rows: int, width: int, count: int, seed: int, device="cpu") -> float:
    """Largest relative error of the op against the reference over the rows below ``count``;
    indices cover every source row and the zero row past them (padding pairs)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    source = torch.randn(sources, width, generator=gen, device=device)
    index = torch.randint(0, sources + 1, (rows,), generator=gen, device=device)
    scale = torch.rand(rows, generator=gen, device=device)
    count_t = torch.tensor([count], device=device)
    got = scaled_rows(source, index, scale, count_t, dtype)[:count].float()
    want = scaled_rows_reference(source, index, scale, count_t, dtype)[:count].float()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30)) if count else 0.0


def check_kernel() -> dict:
    return {
        f"{dtype}-{count}": kernel_error(dtype, 23, 70, 300, count, seed=count + 3)
        for dtype in (torch.float32, torch.bfloat16)
        for count in (0, 15, 16, 70)
    }


def check_opcheck() -> dict:
    """opcheck with every row real (rows past the count are left unwritten)."""
    source, index, scale = torch.randn(9, 20), torch.randint(0, 10, (12,)), torch.rand(12)
    torch.library.opcheck(torch.ops.hone.scaled_rows.default, (source, index, scale, torch.tensor([12]), torch.bfloat16))
    return {"scaled_rows": "ok"}


CHECKS = {"kernel": check_kernel, "opcheck": check_opcheck}


if __name__ == "__main__":
    print("RESULT " + json.dumps(CHECKS[sys.argv[1]]()))
