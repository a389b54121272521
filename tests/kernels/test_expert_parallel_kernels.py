"""Expert parallelism's local step (hone.parallel.expert_parallel.local_experts) through the
grouped kernels equals its plain-PyTorch path, on the CPU under Triton's interpreter (small
sizes, fp32): with no choice held elsewhere, some, and only such choices (an idle rank); the
rows a rank does not compute are skipped, their output is zero and their gradient never
reaches a real row. The checks live in expert_local_checks.py (the GPU test runs them at real
sizes). Skipped where triton is not installed."""

import importlib.util
from pathlib import Path

import pytest
from interpreted import run_interpreted

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (CPU-only torch); the GPU tests cover it"
)


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted([str(Path(__file__).with_name("expert_local_checks.py"))])


@pytest.mark.parametrize("trained", ["lora", "full"])
@pytest.mark.parametrize("layout", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("share", [0.0, 0.6, 1.0])
def test_grouped_local_experts_equal_the_plain_path(results, layout, trained, share):
    errors = results[f"{layout}-{trained}-{share}"]
    assert errors.pop("sentinel_out") == 0.0 and errors.pop("overflow") == 0
    assert {"out", "rows", "weights"} <= set(errors)
    bad = {name: err for name, err in errors.items() if isinstance(err, str) or err > 1e-5}
    assert not bad, bad


@pytest.fixture(scope="module")
def mxfp4_results() -> dict:
    return run_interpreted([str(Path(__file__).with_name("expert_local_mxfp4_checks.py"))])


@pytest.mark.parametrize("layout", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("share", [0.0, 0.6, 1.0])
def test_grouped_mxfp4_local_experts_equal_the_dequantized_reference(mxfp4_results, layout, share):
    """MXFP4 experts under expert parallelism: the grouped MXFP4 kernels on the rank's block (the
    same rows / ends / padding-row contract as bf16) equal the float32 reference on the dequantized
    block, forward and the gradients of the rows, routing weights, LoRA factors (and biases)."""
    errors = mxfp4_results[f"{layout}-{share}"]
    assert errors.pop("sentinel_out") == 0.0 and errors.pop("overflow") == 0
    assert {"out", "rows", "weights", "gu_A", "gu_B", "dn_A", "dn_B"} <= set(errors)
    bad = {name: err for name, err in errors.items() if isinstance(err, str) or err > 1e-5}
    assert not bad, bad


def test_a_compiled_recomputed_local_step_saves_no_pair_row():
    """``expert_parallel_recompute`` under the partitioner Inductor uses: the backward keeps the
    received rows, choices and weights (and the experts), no tensor with a row per pair; the
    local step without it keeps several."""
    result = run_interpreted([str(Path(__file__).with_name("expert_recompute_checks.py"))])
    rows, pairs = result["rows"], result["pairs"]
    assert sum(dim >= pairs for dim in result["kept"]) >= 3
    assert max(result["recomputed"]) == rows and all(dim < pairs for dim in result["recomputed"])
