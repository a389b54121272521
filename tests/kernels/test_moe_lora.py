"""The grouped MoE experts kernels (hone.kernels.moe_lora) against the float32 per-expert
reference, on CPU under Triton's interpreter: output and the gradients of the hidden states,
routing weights, LoRA A/B of both projections, and (full fine-tune cases) expert weights and
biases; uneven loads with empty experts, top-k 1, 2 and 8, both layouts (qwen3_moe
concatenated gate/up; gpt_oss transposed, interleaved, biased, clamped SwiGLU). Plus
``torch.compile(fullgraph=True)`` through the ops and torch.library's opcheck.

``TRITON_INTERPRET=1`` must be set before triton is imported, so each case
(tests/kernels/moe_lora_checks.py) runs in the interpreter process of tests/interpreted.py and
reports measured errors as JSON. Skipped where triton is not installed (CPU-only torch wheels
do not bring it)."""

from pathlib import Path

import pytest
from interpreted import needs_triton, run_interpreted

pytestmark = needs_triton

CHECKS = Path(__file__).with_name("moe_lora_checks.py")


def _interpreted(case: str) -> dict:
    return run_interpreted([str(CHECKS), case])


PARITY_CASES = [
    "qwen_k1_lora",
    "qwen_k2_lora",
    "qwen_k8_lora",
    "qwen_k2_full",
    "qwen_k2_lora_and_weights",
    "gptoss_k2_lora",
    "gptoss_k8_lora",
    "gptoss_k2_full",
]


@pytest.mark.parametrize("case", PARITY_CASES)
def test_grouped_kernels_match_reference(case):
    result = _interpreted(case)
    errors = result["errors"]
    assert "out" in errors and "hidden" in errors and "routing_weights" in errors
    bad = {name: err for name, err in errors.items() if isinstance(err, str) or err > 1e-5}
    assert not bad, f"{case}: relative errors above 1e-5: {bad}"
    if case.startswith("gptoss"):
        assert result["clamped_fraction"] > 0.01  # the SwiGLU clamp is exercised


def test_compile_fullgraph_traces_forward_and_backward():
    errors = _interpreted("compile")["errors"]
    assert set(errors) >= {"out", "hidden", "gu_A", "gu_B", "dn_A", "dn_B"}
    assert all(not isinstance(e, str) and e <= 1e-6 for e in errors.values()), errors


def test_the_memory_budget_weighs_the_grouped_projections_by_their_flops():
    """Taken for free (no FLOP formula, no ban), both grouped projections of an MoE block ran
    again in the backward at a budget of 0.35; weighed by their FLOPs, the knapsack recomputes
    cheaper work first. Unbudgeted, neither runs again."""
    counts = _interpreted("recompute")
    assert counts["unbudgeted"] == 0, counts
    assert counts["bare"] == 2, counts  # the toy reproduces what the fix is for
    assert counts["hone"] < counts["bare"], counts


def test_the_interpreter_tries_exactly_one_autotune_config_per_kernel():
    assert _interpreted("autotune") == {"grouped_mm": 1, "grouped_wgrad": 1}


def test_ops_pass_opcheck():
    assert _interpreted("opcheck") == {
        "grouped_mm": "ok",
        "grouped_wgrad": "ok",
        "moe_lora_linear": "ok",
        "moe_lora_linear_readers": "ok",
    }


def test_gathered_input_gradient_equals_the_atomic_scatter():
    """``readers`` (expert parallelism's gather of dX) gives the scatter's output and gradients."""
    errors = _interpreted("readers")["errors"]
    bad = {name: err for name, err in errors.items() if isinstance(err, str) or err > 1e-6}
    assert not bad, errors
