"""Expert parallelism across 2 gloo processes on the CPU, fp32: each rank holds 4 of 8 experts,
routes its own 16 tokens (top-2) and gets, through the two all-to-all exchanges, exactly what
the single-process all-experts reference gives for those tokens; after a backward of both ranks'
losses, the gradients of each rank's hidden states and routing weights, and of its slice of the
expert LoRA factors (LoRA cases) or of the expert weights and biases (full fine-tune cases),
equal the reference's gradients of the sum of both losses: each expert's gradient holds both
ranks' tokens. Both weight layouts (qwen3_moe; gpt_oss: transposed, interleaved, biased,
clamped SwiGLU). A skewed routing sends every pair to rank 1 (rank 0 computes nothing, five
experts get no token); with a capacity too small for it, every rank reports the overflow and
refuses the step together."""

import pytest
import torch
from fsdp_harness import save, spawn

from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE, moe_experts_reference

WORLD = 2
TOKENS, HIDDEN, EXPERTS, TOP_K, INTER, RANK = 16, 32, 8, 2, 16, 4
SCALING, DOWN_SCALING = 0.5, 0.25
LAYOUTS = {"qwen3_moe": QWEN3_MOE, "gpt_oss": GPT_OSS}
#: name: (layout, trained parameters, routing)
CASES = {
    "qwen3_moe-lora": ("qwen3_moe", "lora", "random"),
    "qwen3_moe-full": ("qwen3_moe", "full", "random"),
    "gpt_oss-lora": ("gpt_oss", "lora", "random"),
    "gpt_oss-full": ("gpt_oss", "full", "random"),
    "qwen3_moe-skewed": ("qwen3_moe", "lora", "skewed"),
}
EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias", "gu_A", "gu_B", "dn_A", "dn_B")


def _case(name: str) -> dict:
    """Every rank's inputs and all experts' weights, the same in every process (seeded)."""
    layout_name, trained, routing = CASES[name]
    layout = LAYOUTS[layout_name]
    gen = torch.Generator().manual_seed(sorted(CASES).index(name))
    rand = lambda *shape, std=1.0: torch.randn(*shape, generator=gen) * std  # noqa: E731
    n = WORLD * TOKENS
    if routing == "random":
        index = torch.rand(n, EXPERTS, generator=gen).argsort(dim=1)[:, :TOP_K]
    else:  # experts 4, 5, 6 only: all on rank 1; experts 0-3 and 7 get no token
        index = 4 + torch.rand(n, 3, generator=gen).argsort(dim=1)[:, :TOP_K]
    gate_up_std = 1.0 if layout is GPT_OSS else 0.3  # gpt_oss: large enough for the SwiGLU clamp to act
    if layout.transposed:
        gate_up, down = rand(EXPERTS, HIDDEN, 2 * INTER, std=gate_up_std), rand(EXPERTS, INTER, HIDDEN, std=0.3)
    else:
        gate_up, down = rand(EXPERTS, 2 * INTER, HIDDEN, std=gate_up_std), rand(EXPERTS, HIDDEN, INTER, std=0.3)
    bias = layout is GPT_OSS
    lora = trained == "lora"
    return dict(
        layout=layout,
        trained=trained,
        hidden=rand(n, HIDDEN),
        index=index,
        weights=torch.softmax(rand(n, TOP_K), dim=1),
        cotangent=rand(n, HIDDEN),
        gate_up_proj=gate_up,
        down_proj=down,
        gate_up_bias=rand(EXPERTS, 2 * INTER) if bias else None,
        down_bias=rand(EXPERTS, HIDDEN) if bias else None,
        gu_A=rand(EXPERTS, RANK, HIDDEN, std=0.3) if lora else None,
        gu_B=rand(EXPERTS, 2 * INTER, RANK, std=0.3) if lora else None,
        dn_A=rand(EXPERTS, RANK, INTER, std=0.3) if lora else None,
        dn_B=rand(EXPERTS, HIDDEN, RANK, std=0.3) if lora else None,
    )


def _leaves(case: dict, take) -> dict:
    """``take(name, tensor)`` of every tensor as a leaf; the trained ones require grad."""
    lora, full = {"gu_A", "gu_B", "dn_A", "dn_B"}, {"gate_up_proj", "down_proj", "gate_up_bias", "down_bias"}
    trained = {"hidden", "weights"} | (lora if case["trained"] == "lora" else full)
    names = ("hidden", "weights", *EXPERT_TENSORS)
    return {
        name: None if case[name] is None else take(name, case[name]).clone().requires_grad_(name in trained) for name in names
    }


def _lora(t: dict):
    if t["gu_A"] is None:
        return None, None
    return (t["gu_A"], t["gu_B"]), (t["dn_A"], t["dn_B"])


def _grads(t: dict) -> dict:
    return {name: v.grad.clone() for name, v in t.items() if v is not None and v.grad is not None}


def _worker(rank: int, out) -> None:
    from hone.parallel.expert_parallel import ExpertCapacityError, ExpertShard, check_overflow, expert_parallel_experts

    shard = ExpertShard.of_group(EXPERTS)
    tokens = slice(rank * TOKENS, (rank + 1) * TOKENS)
    results = {}
    for name in CASES:
        case = _case(name)
        t = _leaves(case, lambda key, v: v[tokens] if key in ("hidden", "weights") else shard.local(v))
        run = lambda capacity=None: expert_parallel_experts(  # noqa: E731
            t["hidden"], case["index"][tokens], t["weights"], t["gate_up_proj"], t["down_proj"], case["layout"], shard,
            biases=(t["gate_up_bias"], t["down_bias"]), lora=_lora(t), scaling=SCALING, down_scaling=DOWN_SCALING,
            capacity=capacity,
        )  # fmt: skip
        got, overflow = run()
        (got * case["cotangent"][tokens]).sum().backward()
        results[name] = {"out": got.detach(), "overflow": overflow.item(), "grads": _grads(t)}
        if name.endswith("skewed"):  # 8 slots for the 32 pairs each rank sends to rank 1
            _, overflow = run(capacity=8)
            results[name]["small_overflow"] = overflow.item()
            try:
                check_overflow(overflow, 8, shard)
            except ExpertCapacityError as exc:
                results[name]["refused"] = str(exc)
    save(results, out / f"{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("expert_parallel")
    spawn(_worker, WORLD, out, timeout_s=300)
    return [torch.load(out / f"{rank}.pt") for rank in range(WORLD)]


def _reference(name: str) -> tuple[torch.Tensor, dict]:
    """The single-process output over every rank's tokens, and the gradients of the sum of both losses."""
    case = _case(name)
    t = _leaves(case, lambda key, v: v)
    gate_up_lora, down_lora = _lora(t)
    want = moe_experts_reference(
        t["hidden"], case["index"], t["weights"], t["gate_up_proj"], t["down_proj"], case["layout"],
        t["gate_up_bias"], t["down_bias"], gate_up_lora, down_lora, SCALING, DOWN_SCALING,
    )  # fmt: skip
    (want * case["cotangent"]).sum().backward()
    return want.detach(), _grads(t)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert err <= 1e-5, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_gets_the_reference_output_and_gradients(ranks, name):
    want, want_grads = _reference(name)
    per_expert = EXPERTS // WORLD
    for rank, results in enumerate(ranks):
        got = results[name]
        tokens = slice(rank * TOKENS, (rank + 1) * TOKENS)
        experts = slice(rank * per_expert, (rank + 1) * per_expert)
        assert got["overflow"] == 0  # the default capacity, T * k, cannot overflow
        _close(got["out"], want[tokens], f"{name} rank {rank} out")
        assert set(got["grads"]) == set(want_grads)
        for param, grad in want_grads.items():
            expected = grad[tokens] if param in ("hidden", "weights") else grad[experts]
            if expected.abs().sum() == 0:  # an expert block with no token (skewed routing)
                assert got["grads"][param].abs().sum() == 0, f"{name} rank {rank} {param}"
            else:
                _close(got["grads"][param], expected, f"{name} rank {rank} grad of {param}")


def test_skewed_routing_leaves_rank_0_idle_and_empty_experts(ranks):
    want, want_grads = _reference("qwen3_moe-skewed")
    assert ranks[0]["qwen3_moe-skewed"]["grads"]["gu_A"].abs().sum() == 0  # experts 0-3: no token on any rank
    assert want_grads["gu_A"][7].abs().sum() == 0 and want_grads["gu_A"][4:7].abs().sum() > 0  # expert 7 too


def test_a_capacity_too_small_is_reported_on_every_rank_and_refused_together(ranks):
    for results in ranks:
        got = results["qwen3_moe-skewed"]
        assert got["small_overflow"] == 2 * TOKENS - 8  # every pair goes to rank 1; 8 fit
        assert "48 token-expert pair(s) exceeded the capacity of 8" in got["refused"]


def test_the_gpt_oss_cases_exercise_the_swiglu_clamp():
    case = _case("gpt_oss-lora")
    gate_up = case["hidden"] @ case["gate_up_proj"][0]  # [in, out]: the transposed layout
    assert (gate_up.abs() > GPT_OSS.swiglu_limit).float().mean() > 0.05
