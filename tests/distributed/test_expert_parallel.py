"""Expert parallelism across 2 gloo processes on the CPU, fp32: each rank holds 4 of 8 experts,
routes its own 16 tokens (top-2) and gets, through the two all-to-all exchanges, exactly what
the single-process all-experts reference gives for those tokens; after a backward of both ranks'
losses, the gradients of each rank's hidden states and routing weights, and of its slice of the
expert LoRA factors (LoRA cases) or of the expert weights and biases (full fine-tune cases),
equal the reference's gradients of the sum of both losses: each expert's gradient holds both
ranks' tokens. Both weight layouts (qwen3_moe; gpt_oss: transposed, interleaved, biased,
clamped SwiGLU). A skewed routing sends every pair to rank 1 (rank 0 computes nothing, five
experts get no token); with a capacity too small for it, every rank reports the overflow and
refuses the step together. The cases live in expert_parallel_cases.py (the 2-GPU test runs them too)."""

import pytest
import torch
from expert_parallel_cases import (
    CASES,
    CHUNKED,
    RECOMPUTED,
    SMALL_CAPACITY,
    TOKENS,
    TOP_K,
    WORLD,
    compare,
    make_case,
    rank_results,
    reference,
)
from fsdp_harness import save, spawn

from hone.kernels.moe_lora_reference import GPT_OSS


def _worker(rank: int, out) -> None:
    save(rank_results(rank), out / f"{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("expert_parallel")
    spawn(_worker, WORLD, out, timeout_s=300)
    return [torch.load(out / f"{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_gets_the_reference_output_and_gradients(ranks, name):
    assert compare(ranks, name, tolerance=1e-5) == []


@pytest.mark.parametrize("chunks", list(CHUNKED))
@pytest.mark.parametrize("name", list(CASES))
def test_tokens_exchanged_in_chunks_give_the_same_outputs_and_gradients(ranks, name, chunks):
    """Every chunk's exchanges first, then each chunk's experts and combine: the same function
    (three uneven chunks; four of which two are empty where the exchanges are sized for more tokens)."""
    assert compare(ranks, f"{name}/{chunks}", tolerance=1e-5) == []


@pytest.mark.parametrize("variant", list(RECOMPUTED))
@pytest.mark.parametrize("name", list(CASES))
def test_local_experts_recomputed_in_the_backward_give_the_same_outputs_and_gradients(ranks, name, variant):
    """``recompute``: the backward keeps the received rows only and runs the local experts again
    (whole, and in three chunks)."""
    assert compare(ranks, f"{name}/{variant}", tolerance=1e-5) == []


def test_skewed_routing_leaves_rank_0_idle_and_empty_experts(ranks):
    _, want_grads = reference("qwen3_moe-skewed")
    assert ranks[0]["qwen3_moe-skewed"]["grads"]["gu_A"].abs().sum() == 0  # experts 0-3: no token on any rank
    assert want_grads["gu_A"][7].abs().sum() == 0 and want_grads["gu_A"][4:7].abs().sum() > 0  # expert 7 too


def test_a_capacity_too_small_is_reported_on_every_rank_and_refused_together(ranks):
    every_pair = WORLD * TOKENS * TOP_K  # all of them reach rank 1's experts; 8 fit
    assert [results["qwen3_moe-skewed"]["small_overflow"] for results in ranks] == [0, every_pair - SMALL_CAPACITY]
    for results in ranks:
        assert (
            f"{every_pair - SMALL_CAPACITY} token-expert pair(s) exceeded the capacity of {SMALL_CAPACITY}"
            in (results["qwen3_moe-skewed"]["refused"])
        )


def test_the_gpt_oss_cases_exercise_the_swiglu_clamp():
    case = make_case("gpt_oss-lora")
    gate_up = case["hidden"] @ case["gate_up_proj"][0]  # [in, out]: the transposed layout
    assert (gate_up.abs() > GPT_OSS.swiglu_limit).float().mean() > 0.05
