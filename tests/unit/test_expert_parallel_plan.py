"""Expert parallelism without a process group: the send buffer's layout on a hand-made routing
(slot order, sentinels, overflow), the capacity rule, the shard's checks, and the whole
dispatch -> local experts -> combine path on one rank (``N = 1``: the exchanges are the
identity) against the all-experts reference, including a capacity too small to fit.
The 2-process exchanges are tested in tests/distributed/test_expert_parallel.py."""

import pytest
import torch

from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE, moe_experts_reference
from hone.parallel.expert_parallel import (
    ExpertCapacityError,
    ExpertShard,
    LocalExperts,
    check_overflow,
    dispatch,
    expert_capacity,
    expert_parallel_experts,
    local_experts,
    plan_send,
)

# Two ranks, 4 experts (2 each); 3 tokens, top-2. Pairs in order: p0 = (t0, e3), p1 = (t0, e0),
# p2 = (t1, e1), p3 = (t1, e2), p4 = (t2, e2), p5 = (t2, e3).
ROUTING = torch.tensor([[3, 0], [1, 2], [2, 3]])


def test_send_buffer_groups_pairs_by_destination_in_pair_order_and_pads_with_sentinels():
    plan = plan_send(ROUTING, ExpertShard(size=2, rank=0, num_experts=4), capacity=4)
    # rank 0 gets p1, p2 then two sentinels; rank 1 gets p0, p3, p4, p5 (token 3 = the zero row).
    assert plan.source.tolist() == [0, 1, 3, 3, 0, 1, 2, 2]
    assert plan.local_ids.tolist() == [0, 1, 2, 2, 1, 0, 0, 1]  # local id 2 = E / N: sentinel
    assert plan.slot.tolist() == [4, 0, 1, 5, 6, 7]
    assert plan.kept.all() and plan.overflow.item() == 0


def test_pairs_past_capacity_are_counted_not_placed():
    plan = plan_send(ROUTING, ExpertShard(size=2, rank=1, num_experts=4), capacity=3)
    assert plan.source.tolist() == [0, 1, 3, 0, 1, 2]
    assert plan.local_ids.tolist() == [0, 1, 2, 1, 0, 0]
    assert plan.kept.tolist() == [True, True, True, True, True, False]  # p5: rank 1's 4th pair
    assert plan.overflow.item() == 1


def test_capacity_rule():
    assert expert_capacity(16, 2, 4) == 32  # default: T * k, nothing can overflow
    assert expert_capacity(16, 2, 4, capacity_factor=1.0) == 8  # ceil(32 / 4) = 8
    assert expert_capacity(16, 2, 4, capacity_factor=1.25) == 16  # ceil(10) rounded up to 16
    assert expert_capacity(3, 2, 2, capacity_factor=8.0) == 8  # at most T * k = 6, rounded up to 8
    with pytest.raises(ValueError, match="capacity_factor 0"):
        expert_capacity(16, 2, 4, capacity_factor=0)


def test_shard_checks_and_slices():
    with pytest.raises(ValueError, match="6 experts cannot be split evenly over 4"):
        ExpertShard(size=4, rank=0, num_experts=6)
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        ExpertShard(size=2, rank=2, num_experts=4)
    shard = ExpertShard(size=4, rank=2, num_experts=8)
    assert (shard.local_count, shard.first) == (2, 4)
    assert shard.local(torch.arange(8)).tolist() == [4, 5]


def _experts(layout, num_experts=4, hidden=8, inter=6, rank=2, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    if layout.transposed:
        gate_up, down = rand(num_experts, hidden, 2 * inter), rand(num_experts, inter, hidden)
    else:
        gate_up, down = rand(num_experts, 2 * inter, hidden), rand(num_experts, hidden, inter)
    return dict(
        gate_up_proj=gate_up,
        down_proj=down,
        gate_up_bias=rand(num_experts, 2 * inter) if bias else None,
        down_bias=rand(num_experts, hidden) if bias else None,
        gate_up_lora=(rand(num_experts, rank, hidden), rand(num_experts, 2 * inter, rank)),
        down_lora=(rand(num_experts, rank, inter), rand(num_experts, hidden, rank)),
    )


def test_local_experts_leave_sentinel_rows_zero():
    w = _experts(QWEN3_MOE)
    rows = torch.randn(5, 8)
    ids = torch.tensor([1, 4, 0, 4, 1])  # 4 = sentinel (4 local experts)
    experts = LocalExperts(w["gate_up_proj"], w["down_proj"], QWEN3_MOE, gate_up_lora=w["gate_up_lora"], scaling=0.5)
    got = local_experts(rows, ids, experts, use_kernels=False)
    assert got[1].abs().sum() == 0 and got[3].abs().sum() == 0
    want = moe_experts_reference(
        rows[[0, 2, 4]], ids[[0, 2, 4]].unsqueeze(1), torch.ones(3, 1), w["gate_up_proj"], w["down_proj"], QWEN3_MOE,
        gate_up_lora=w["gate_up_lora"], scaling=0.5,
    )  # fmt: skip
    torch.testing.assert_close(got[[0, 2, 4]], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [QWEN3_MOE, GPT_OSS], ids=["qwen3_moe", "gpt_oss"])
def test_one_rank_equals_the_reference(layout):
    w = _experts(layout, bias=layout is GPT_OSS)
    hidden = torch.randn(6, 8)
    index = torch.tensor([[0, 3], [3, 1], [2, 0], [3, 2], [0, 1], [1, 3]])
    weights = torch.rand(6, 2)
    want = moe_experts_reference(hidden, index, weights, layout=layout, scaling=0.5, **w)
    shard = ExpertShard(size=1, rank=0, num_experts=4)
    got, overflow = expert_parallel_experts(
        hidden, index, weights, w["gate_up_proj"], w["down_proj"], layout, shard,
        biases=(w["gate_up_bias"], w["down_bias"]), lora=(w["gate_up_lora"], w["down_lora"]), scaling=0.5,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert overflow.item() == 0
    check_overflow(overflow, 12)  # nothing to refuse


def test_a_capacity_too_small_is_reported_and_refused():
    w = _experts(QWEN3_MOE)
    hidden, index, weights = torch.randn(6, 8), torch.randint(0, 4, (6, 2)), torch.rand(6, 2)
    shard = ExpertShard(size=1, rank=0, num_experts=4)
    _, overflow = expert_parallel_experts(hidden, index, weights, w["gate_up_proj"], w["down_proj"], QWEN3_MOE, shard, capacity=8)
    assert overflow.item() == 12 - 8
    with pytest.raises(ExpertCapacityError, match="4 token-expert pair\\(s\\) exceeded the capacity of 8"):
        check_overflow(overflow, 8)


def test_local_weights_must_match_the_shard():
    w = _experts(QWEN3_MOE)
    shard = ExpertShard(size=2, rank=0, num_experts=4)
    with pytest.raises(ValueError, match="gate_up_local holds 4 experts; rank 0 of 2 holds 2 of 4"):
        expert_parallel_experts(
            torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), w["gate_up_proj"], w["down_proj"],
            QWEN3_MOE, shard,
        )  # fmt: skip


def test_dispatch_sums_each_tokens_gradient_in_float32_and_drops_the_sentinels():
    torch.manual_seed(0)
    shard = ExpertShard(size=1, rank=0, num_experts=4)
    hidden = torch.randn(6, 8).to(torch.bfloat16).requires_grad_()
    index = torch.rand(6, 4).argsort(dim=1)  # top-4: four rows per token to sum back
    sent = dispatch(hidden, index, shard, capacity=32)  # 8 sentinel slots past the 24 pairs
    assert sent.rows.dtype == torch.bfloat16 and sent.rows.shape == (32, 8)
    assert sent.plan.source[24:].tolist() == [6] * 8 and sent.rows[24:].abs().sum() == 0
    grad_rows = torch.randn(32, 8).to(torch.bfloat16)
    sent.rows.backward(grad_rows)
    # rounded once, not after each of the 4 additions (bf16 additions round each time)
    want = torch.zeros(7, 8).index_add_(0, sent.plan.source, grad_rows.float())[:6].to(torch.bfloat16)
    assert torch.equal(hidden.grad, want)
