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

# Two ranks, 4 experts (2 each); 3 tokens, top-2: t0 -> (e3, e0), t1 -> (e1, e2), t2 -> (e2, e3).
ROUTING = torch.tensor([[3, 0], [1, 2], [2, 3]])


def test_each_token_goes_once_to_each_rank_holding_one_of_its_experts():
    plan = plan_send(ROUTING, ExpertShard(size=2, rank=0, num_experts=4), slots=4)
    # rank 0 (e0, e1) gets t0 and t1, then two sentinels; rank 1 (e2, e3) gets t0, t1, t2 once each.
    assert plan.source.tolist() == [0, 1, 3, 3, 0, 1, 2, 3]  # token 3 = the zero row
    # each slot's two choices as local ids at its destination; 2 (= E / N) where held elsewhere
    assert plan.local_ids.tolist() == [[2, 0], [1, 2], [2, 2], [2, 2], [1, 2], [2, 0], [0, 1], [2, 2]]
    assert plan.slot.tolist() == [[0, 4], [1, 5], [8, 6]]  # 8 = N * S: t2 has nothing on rank 0


def test_the_plan_is_one_opaque_op_that_compiles_to_the_eager_plan():
    """The plan runs as a custom op (Inductor must not fuse its slot arithmetic: see
    :func:`plan_send`): its fake shapes, schema and aliasing pass ``opcheck``, and a compiled
    caller gets the eager plan on fresh random routing."""
    from hone.parallel.expert_parallel import _plan_send_op

    gen = torch.Generator().manual_seed(7)
    routing = torch.rand(12, 8, generator=gen).argsort(dim=1)[:, :3]
    torch.library.opcheck(_plan_send_op, (routing, 2, 4, 12))
    shard = ExpertShard(size=2, rank=1, num_experts=8)
    eager = plan_send(routing, shard, slots=12)
    compiled = torch.compile(lambda r: plan_send(r, shard, 12), fullgraph=True, backend="inductor")(routing)
    for name in ("source", "local_ids", "slot"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name


def test_token_slots_must_hold_every_token():
    with pytest.raises(ValueError, match="2 token slots per rank cannot hold the 3 tokens"):
        plan_send(ROUTING, ExpertShard(size=2, rank=0, num_experts=4), slots=2)


def test_capacity_rule():
    assert expert_capacity(16, 2, 4) == 128  # default: N * S * k, nothing can overflow
    assert expert_capacity(16, 2, 4, local_count=1) == 64  # one local expert: a token brings at most one pair
    assert expert_capacity(16, 2, 4, capacity_factor=1.0) == 32  # S * k: balanced routing
    assert expert_capacity(16, 2, 4, capacity_factor=1.25) == 40
    assert expert_capacity(3, 2, 2, capacity_factor=8.0) == 16  # at most the worst case, 12, rounded up to 16
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


def test_local_experts_sum_each_rows_local_choices_and_leave_sentinel_rows_zero():
    w = _experts(QWEN3_MOE)
    rows = torch.randn(5, 8)
    ids = torch.tensor([[1, 4], [4, 4], [0, 3], [4, 4], [4, 1]])  # 4 = E / N: a choice held elsewhere
    weights = torch.rand(5, 2) * (ids < 4)  # as dispatched: zero where the choice is not here
    experts = LocalExperts(w["gate_up_proj"], w["down_proj"], QWEN3_MOE, gate_up_lora=w["gate_up_lora"], scaling=0.5)
    got = local_experts(rows, ids, weights, experts, use_kernels=False)
    assert got.rows[1].abs().sum() == 0 and got.rows[3].abs().sum() == 0 and got.overflow.item() == 0
    real = [0, 2, 4]
    want = moe_experts_reference(
        rows[real], ids[real].clamp(max=3), weights[real], w["gate_up_proj"], w["down_proj"], QWEN3_MOE,
        gate_up_lora=w["gate_up_lora"], scaling=0.5,
    )  # fmt: skip
    torch.testing.assert_close(got.rows[real], want, rtol=1e-5, atol=1e-5)
    assert local_experts(rows, ids, weights, experts, capacity=3, use_kernels=False).overflow.item() == 4 - 3


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
    # with the balanced share (S x k = 12 here) the error says what the layer received
    with pytest.raises(ExpertCapacityError, match="received 12 pairs, 1.000x the balanced share of 12"):
        check_overflow(overflow, 8, share=12)


def test_local_weights_must_match_the_shard():
    w = _experts(QWEN3_MOE)
    shard = ExpertShard(size=2, rank=0, num_experts=4)
    with pytest.raises(ValueError, match="gate_up_local holds 4 experts; rank 0 of 2 holds 2 of 4"):
        expert_parallel_experts(
            torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), w["gate_up_proj"], w["down_proj"],
            QWEN3_MOE, shard,
        )  # fmt: skip


def test_dispatch_pads_with_zero_sentinel_slots_whose_gradients_are_dropped():
    torch.manual_seed(0)
    shard = ExpertShard(size=1, rank=0, num_experts=4)
    hidden = torch.randn(6, 8).to(torch.bfloat16).requires_grad_()
    weights = torch.rand(6, 4, requires_grad=True)
    index = torch.rand(6, 4).argsort(dim=1)
    sent = dispatch(hidden, index, weights, shard, slots=8)  # 2 sentinel slots past the 6 tokens
    assert sent.rows.dtype == torch.bfloat16 and sent.rows.shape == (8, 8)
    assert sent.plan.source[6:].tolist() == [6, 6] and sent.rows[6:].abs().sum() == 0
    assert sent.local_ids[6:].eq(4).all() and sent.weights[6:].abs().sum() == 0
    torch.testing.assert_close(sent.weights[:6], weights)
    grad_rows = torch.randn(8, 8).to(torch.bfloat16)
    sent.rows.backward(grad_rows)
    assert torch.equal(hidden.grad, grad_rows[:6])
