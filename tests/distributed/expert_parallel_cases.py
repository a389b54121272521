"""The expert-parallel cases shared by the gloo test (tests/distributed/test_expert_parallel.py)
and the NCCL one (tests/gpu/test_expert_parallel_gpu.py): every rank's tokens and all experts'
weights, seeded so that every process builds the same; one rank's run of
:func:`~hone.parallel.expert_parallel.expert_parallel_experts` on its tokens and expert block;
and the single-process all-experts reference of both ranks' tokens."""

from __future__ import annotations

import torch

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
SMALL_CAPACITY = 8  # pair rows: the skewed case's 64 pairs, all on rank 1, do not fit
#: Token chunks the cases also run in (name suffix): 3 of 6, 6 and 4 tokens; 4 of 10 slots each
#: with exchanges sized for 40 tokens (a rank routing fewer than the most: two empty chunks).
CHUNKED = {"chunks=3": {"chunks": 3}, "chunks=4,max=40": {"chunks": 4, "max_tokens": 40}}
#: The local experts recomputed in the backward (``recompute``), whole and in chunks.
RECOMPUTED = {"recompute": {"recompute": True}, "chunks=3,recompute": {"chunks": 3, "recompute": True}}
#: Every variant a case also runs as (``case/suffix``).
VARIANTS = {**CHUNKED, **RECOMPUTED}


def make_case(name: str) -> dict:
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


def leaves(case: dict, take, device: str = "cpu") -> dict:
    """``take(name, tensor)`` of every tensor as a leaf on ``device``; the trained ones require grad."""
    lora, full = {"gu_A", "gu_B", "dn_A", "dn_B"}, {"gate_up_proj", "down_proj", "gate_up_bias", "down_bias"}
    trained = {"hidden", "weights"} | (lora if case["trained"] == "lora" else full)
    names = ("hidden", "weights", *EXPERT_TENSORS)
    return {
        name: None if case[name] is None else take(name, case[name]).to(device).clone().requires_grad_(name in trained)
        for name in names
    }


def lora_of(t: dict):
    if t["gu_A"] is None:
        return None, None
    return (t["gu_A"], t["gu_B"]), (t["dn_A"], t["dn_B"])


def grads_of(t: dict) -> dict:
    return {name: v.grad.detach().cpu().clone() for name, v in t.items() if v is not None and v.grad is not None}


def rank_results(rank: int, device: str = "cpu", use_kernels: bool | None = None) -> dict:
    """This rank's output, overflow and gradients for every case (inside an initialised group),
    and for the skewed case the overflow at a capacity too small and the error that refuses it."""
    from hone.parallel.expert_parallel import ExpertCapacityError, ExpertShard, check_overflow, expert_parallel_experts

    shard = ExpertShard.of_group(EXPERTS)
    tokens = slice(rank * TOKENS, (rank + 1) * TOKENS)
    results = {}
    for name in CASES:
        case = make_case(name)
        t = leaves(case, lambda key, v: v[tokens] if key in ("hidden", "weights") else shard.local(v), device)
        index = case["index"][tokens].to(device)

        def run(capacity=None, t=t, case=case, index=index, **variant):
            return expert_parallel_experts(
                t["hidden"], index, t["weights"], t["gate_up_proj"], t["down_proj"], case["layout"], shard,
                biases=(t["gate_up_bias"], t["down_bias"]), lora=lora_of(t), scaling=SCALING, down_scaling=DOWN_SCALING,
                capacity=capacity, use_kernels=use_kernels, **variant,
            )  # fmt: skip

        got, overflow = run()
        (got * case["cotangent"][tokens].to(device)).sum().backward()
        results[name] = {"out": got.detach().cpu(), "overflow": overflow.item(), "grads": grads_of(t)}
        for suffix, variant in VARIANTS.items():
            t = leaves(case, lambda key, v: v[tokens] if key in ("hidden", "weights") else shard.local(v), device)
            got, overflow = run(t=t, **variant)
            (got * case["cotangent"][tokens].to(device)).sum().backward()
            results[f"{name}/{suffix}"] = {"out": got.detach().cpu(), "overflow": overflow.item(), "grads": grads_of(t)}
        if name.endswith("skewed"):
            _, overflow = run(capacity=SMALL_CAPACITY)
            results[name]["small_overflow"] = overflow.item()
            try:
                check_overflow(overflow, SMALL_CAPACITY, shard)
            except ExpertCapacityError as exc:
                results[name]["refused"] = str(exc)
    return results


def reference(name: str) -> tuple[torch.Tensor, dict]:
    """The single-process output over every rank's tokens (float32, CPU), and the gradients of the sum of both losses."""
    case = make_case(name)
    t = leaves(case, lambda key, v: v)
    gate_up_lora, down_lora = lora_of(t)
    want = moe_experts_reference(
        t["hidden"], case["index"], t["weights"], t["gate_up_proj"], t["down_proj"], case["layout"],
        t["gate_up_bias"], t["down_bias"], gate_up_lora, down_lora, SCALING, DOWN_SCALING,
    )  # fmt: skip
    (want * case["cotangent"]).sum().backward()
    return want.detach(), grads_of(t)


def compare(ranks: list[dict], name: str, tolerance: float) -> list[str]:
    """What differs (relative error in norm above ``tolerance``) between the ranks' results and the
    reference (``name``: a case, or a case run as a variant, ``case/suffix``: :data:`VARIANTS`)."""
    want, want_grads = reference(name.split("/")[0])
    per_expert = EXPERTS // WORLD
    problems = []

    def check(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        if expected.abs().sum() == 0:  # an expert block with no token (skewed routing)
            if got.abs().sum() != 0:
                problems.append(f"{what}: not zero")
            return
        err = ((got - expected).norm() / expected.norm()).item()
        if not err <= tolerance:
            problems.append(f"{what}: relative error {err:.2e}")

    for rank, results in enumerate(ranks):
        got = results[name]
        tokens = slice(rank * TOKENS, (rank + 1) * TOKENS)
        experts = slice(rank * per_expert, (rank + 1) * per_expert)
        if got["overflow"] != 0:  # the default capacity, T * k, cannot overflow
            problems.append(f"rank {rank}: overflow {got['overflow']}")
        check(got["out"], want[tokens], f"{name} rank {rank} out")
        if set(got["grads"]) != set(want_grads):
            problems.append(f"rank {rank}: gradients of {sorted(got['grads'])}, expected {sorted(want_grads)}")
            continue
        for param, grad in want_grads.items():
            expected = grad[tokens] if param in ("hidden", "weights") else grad[experts]
            check(got["grads"][param], expected, f"{name} rank {rank} grad of {param}")
    return problems
