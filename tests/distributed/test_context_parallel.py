"""Context parallelism across 2 and 4 gloo processes on the CPU, fp32: every rank holds the same
micro-batch, runs the decoder on its shard of each row (``shard_micro_batch``) through the
wrapped attention (``enable_context_parallel``: q, k, v traded from a slice of the positions to
a share of the heads and back), and computes the loss sum over its shard's targets. The ranks'
loss sums added and their gradients summed equal one process's on the whole micro-batch within
1e-5 (relative), for tiny Qwen3 and Llama models, LoRA and full fine-tune, padded rows of
different lengths and packed rows (hone's document mask or the documents' boundaries, built over
the whole sequence before sharding), through sdpa, hone's causal sdpa and hone's varlen kernel,
with grouped-query attention on 4 ranks. The control runs the same shards without the exchange
(each rank attending over its own slice): its loss is far off, so the comparison can fail.

The exchange itself: ``seq_to_heads`` gives each rank the whole sequence of its block of heads,
``heads_to_seq`` is its inverse, and both pass gradients back to where the values came from."""

import pytest
import torch
from context_parallel_cases import CASES_2, CASES_4, Case, rank_run, reference
from fsdp_harness import save, spawn

from hone.testing import norm_error

CONTROL = CASES_2[0]


def _exchange_checks(rank: int, size: int) -> dict:
    """seq_to_heads / heads_to_seq against slices of one global tensor, forward and backward."""
    from hone.parallel.context_parallel import ContextShard, heads_to_seq, seq_to_heads, seqs_to_heads

    shard = ContextShard.of_group()
    gen = torch.Generator().manual_seed(7)
    batch, heads, length, dim = 2, 4 * size, 4 * size, 3
    whole = torch.randn(batch, heads, length, dim, generator=gen)  # [B, H, T, D], the same on every rank
    cotangent = torch.randn(batch, heads, length, dim, generator=gen)
    mine = shard.local(whole, dim=2).clone().requires_grad_(True)  # this rank's positions, every head
    got = seq_to_heads(mine, shard)
    mine_heads = shard.local(whole, dim=1)
    (got * shard.local(cotangent, dim=1)).sum().backward()
    back = heads_to_seq(got.transpose(1, 2), shard)  # [B, T/N, H, D]
    # q, k, v together (grouped heads: H, H/2, H/2) in one exchange: each as if alone, gradients too
    parts = [mine.detach()[:, :h].clone().requires_grad_(True) for h in (heads, heads // 2, heads // 2)]
    together = seqs_to_heads(tuple(parts), shard)
    sum((t * t.detach().cos()).sum() for t in together).backward()
    alone = [seq_to_heads(p.detach(), shard) for p in parts]
    return {
        "to_heads": torch.equal(got, mine_heads),
        "grad": torch.equal(mine.grad, shard.local(cotangent, dim=2)),
        "round_trip": torch.equal(back, mine.detach().transpose(1, 2)),
        "together": all(torch.equal(a, b) for a, b in zip(together, alone, strict=True)),
        "together_grad": all(torch.equal(p.grad, seq_to_heads_grad) for p, seq_to_heads_grad in _alone_grads(parts, shard)),
    }


def _alone_grads(parts, shard):
    """Each part's gradient through its own seq_to_heads (the reference for the fused exchange)."""
    from hone.parallel.context_parallel import seq_to_heads

    for part in parts:
        leaf = part.detach().clone().requires_grad_(True)
        out = seq_to_heads(leaf, shard)
        (out * out.detach().cos()).sum().backward()
        yield part, leaf.grad


def _worker(rank: int, cases: list[Case], out) -> None:
    import torch.distributed as dist

    results = {case.name: {"want": reference(case), "got": rank_run(case)} for case in cases}
    if cases[0].size == 2:
        results["control"] = rank_run(CONTROL, wrapped=False)
    results["exchange"] = _exchange_checks(rank, dist.get_world_size())
    save(results, out / f"{rank}.pt")


def _spawned(tmp_path_factory, cases: list[Case]) -> list[dict]:
    size = cases[0].size
    out = tmp_path_factory.mktemp(f"context_parallel_{size}")
    spawn(_worker, size, cases, out, timeout_s=600)
    return [torch.load(out / f"{rank}.pt") for rank in range(size)]


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    return _spawned(tmp_path_factory, CASES_2)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    return _spawned(tmp_path_factory, CASES_4)


def _check(ranks: list[dict], case: Case) -> None:
    for rank, results in enumerate(ranks):
        want, got = results[case.name]["want"], results[case.name]["got"]
        assert got["record"]["size"] == case.size and got["record"]["wraps"] is not None, got["record"]
        assert (got["trained"], got["tokens"]) == (want["trained"], want["tokens"]), rank
        assert want["trained"] > 0 and want["loss"] > 0
        assert norm_error(got["loss"], want["loss"]) < 1e-5, (rank, got["loss"], want["loss"])
        assert set(got["grads"]) == set(want["grads"]) and want["grads"], rank
        for name, grad in want["grads"].items():
            assert grad.abs().sum() > 0, name  # a zero gradient could not tell anything apart
            assert norm_error(got["grads"][name], grad) < 1e-5, (rank, name, norm_error(got["grads"][name], grad))


@pytest.mark.parametrize("case", CASES_2, ids=lambda c: c.name)
def test_two_ranks_give_one_process_loss_and_gradients(two, case):
    _check(two, case)


@pytest.mark.parametrize("case", CASES_4, ids=lambda c: c.name)
def test_four_ranks_give_one_process_loss_and_gradients(four, case):
    _check(four, case)


def test_without_the_exchange_the_loss_is_wrong(two):
    """The control: the shards through the plain model (no wrapper) are far from the reference."""
    for results in two:
        want, got = results[CONTROL.name]["want"], results["control"]
        assert (got["trained"], got["tokens"]) == (want["trained"], want["tokens"])
        assert norm_error(got["loss"], want["loss"]) > 1e-4, (got["loss"], want["loss"])  # 10x the tolerance
        worst = max(norm_error(got["grads"][name], grad) for name, grad in want["grads"].items())
        assert worst > 1e-2, worst


@pytest.mark.parametrize("fixture", ["two", "four"])
def test_the_exchange_trades_positions_for_heads_and_back(fixture, request):
    for results in request.getfixturevalue(fixture):
        assert results["exchange"] == {
            "to_heads": True,
            "grad": True,
            "round_trip": True,
            "together": True,
            "together_grad": True,
        }
