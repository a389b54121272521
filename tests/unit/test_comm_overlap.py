"""scripts/comm_overlap.py: the share of NCCL kernel time that ran beside compute kernels."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from comm_overlap import merged, overlap, summarize  # noqa: E402


def _trace(tmp_path: Path, kernels: list[tuple[str, float, float]]) -> Path:
    events = [{"cat": "kernel", "name": name, "ts": ts, "dur": dur} for name, ts, dur in kernels]
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10_000})  # host ops are not kernels
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_an_exchange_that_runs_alone_hides_nothing(tmp_path):
    path = _trace(tmp_path, [("gemm", 0, 1000), ("ncclDevKernel_SendRecv", 1000, 500), ("gemm", 1500, 1000)])
    assert summarize(path).endswith("NCCL 0.5 ms, of which beside compute 0.0 ms (0%)")


def test_time_beside_compute_counts_once_however_many_streams_compute(tmp_path):
    # the exchange (2-4 ms) runs beside two overlapping compute kernels on other streams (1-3, 2.5-3.5 ms)
    path = _trace(tmp_path, [("gemm", 1000, 2000), ("triton_poi", 2500, 1000), ("ncclDevKernel_AllToAll", 2000, 2000)])
    assert "NCCL 2.0 ms, of which beside compute 1.5 ms (75%)" in summarize(path)


@pytest.mark.parametrize(
    "a, b, want",
    [
        ([(0, 10)], [(2, 3), (5, 7)], 3),
        ([(0, 2), (4, 6)], [(1, 5)], 2),
        ([(0, 1)], [(1, 2)], 0),
        ([(3, 9)], [(0, 4), (8, 20)], 2),
    ],
)
def test_overlap_of_disjoint_unions(a, b, want):
    assert overlap(merged(a), merged(b)) == want
    assert merged([(2, 4), (0, 1), (3, 5)]) == [(0, 1), (2, 5)]
