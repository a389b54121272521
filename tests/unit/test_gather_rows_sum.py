"""``gather_rows_sum``: the gather that replaces an atomic scatter over sorted rows (the grouped
kernels' input gradient, the exchanges' backward, expert parallelism's weighted combine of each
received row's pairs), against the plain sums it stands for, on fresh random inputs."""

import pytest
import torch

from hone.kernels.moe_lora import gather_rows_sum


def _readers(n_in: int, k: int, n_sorted: int, generator: torch.Generator) -> torch.Tensor:
    """Each sorted row named by at most one (input row, choice); a quarter of the choices read
    the zero row ``n_sorted`` (a sentinel)."""
    slots = torch.randperm(n_sorted, generator=generator)[: n_in * k]
    readers = torch.full((n_in * k,), n_sorted, dtype=torch.int64)
    taken = torch.rand(n_in * k, generator=generator) < 0.75
    readers[taken] = slots[: int(taken.sum())]
    return readers.view(n_in, k)


@pytest.mark.parametrize("weighted", [False, True])
def test_it_sums_each_rows_readers_in_order_and_never_reads_the_rows_no_one_names(weighted):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n_in, k, n_sorted, width = 7, 3, 40, 5
    readers = _readers(n_in, k, n_sorted, g)
    rows = torch.randn(n_sorted, width, generator=g, dtype=torch.float64).to(torch.bfloat16)
    named = torch.zeros(n_sorted + 1, dtype=torch.bool)
    named[readers.reshape(-1)] = True
    rows[~named[:n_sorted]] = float("nan")  # unwritten capacity rows: never read
    weights = torch.rand(n_in, k, generator=g) + 0.1 if weighted else None
    out = gather_rows_sum(rows, readers, weights)
    padded = torch.cat([rows.float(), torch.zeros(1, width)])
    expected = torch.zeros(n_in, width)
    for i in range(n_in):
        for j in range(k):
            expected[i] += (1.0 if weights is None else weights[i, j]) * padded[readers[i, j]]
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert out.abs().sum() > 0
