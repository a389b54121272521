"""What Inductor's memory-budget partitioner is told hone's opaque ops cost: each compute-heavy
custom op counts its FLOPs (torch's flop counter counts an op without a formula as 0, and the
partitioner recomputed those first, as if free), and hone's budget context keeps them out of the
min-cut's free recomputation (tests/kernels/test_moe_lora.py checks the partition itself)."""

import pytest
import torch
import torch._functorch.config as functorch_config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import hone.kernels.moe_lora  # noqa: F401  (registers the ops and their formulas)
import hone.kernels.moe_mxfp4  # noqa: F401
import hone.kernels.nf4_dequant  # noqa: F401
from hone.kernels.moe_lora import projection_flops
from hone.transforms.checkpointing import memory_budget_context


def _counted(call) -> int:
    with FakeTensorMode(), FlopCounterMode(display=False) as counter:
        call()
    return counter.get_total_flops()


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_a_grouped_projection_counts_its_rows_through_the_base_and_the_lora(transposed, lora):
    rows, n_in, n_out, experts, rank = 20, 16, 24, 4, 2

    def call():
        x = torch.empty(10, n_in)
        index = torch.zeros(rows, dtype=torch.int64)
        ends = torch.full((experts,), rows, dtype=torch.int32)
        weight = torch.empty(experts, n_in, n_out) if transposed else torch.empty(experts, n_out, n_in)
        a = torch.empty(experts, rank, n_in) if lora else None
        b = torch.empty(experts, n_out, rank) if lora else None
        torch.ops.hone.moe_lora_linear(x, index, ends, weight, transposed, None, a, b, 2.0, None)

    expected = 2 * rows * (n_in * n_out + (rank * (n_in + n_out) if lora else 0))
    assert _counted(call) == expected == projection_flops(rows, n_in, n_out, rank if lora else 0)


def test_an_mxfp4_grouped_projection_and_the_4bit_linear_count_their_matmul():
    rows, n_in, n_out, experts, rank = 12, 64, 40, 3, 4

    def mxfp4():
        x = torch.empty(rows, n_in, dtype=torch.bfloat16)
        ends = torch.full((experts,), rows, dtype=torch.int32)
        blocks = torch.empty(experts, n_out, n_in // 32, 16, dtype=torch.uint8)
        scales = torch.empty(experts, n_out, n_in // 32, dtype=torch.uint8)
        a = torch.empty(experts, rank, n_in, dtype=torch.bfloat16)
        b = torch.empty(experts, n_out, rank, dtype=torch.bfloat16)
        torch.ops.hone.moe_mxfp4_lora_linear(x, None, ends, blocks, scales, None, a, b, 2.0, None)

    assert _counted(mxfp4) == projection_flops(rows, n_in, n_out, rank)

    def nf4():
        x = torch.empty(2, 5, n_in, dtype=torch.bfloat16)
        numel = n_in * n_out
        packed, scalers = torch.empty(numel // 2, dtype=torch.uint8), torch.empty(numel // 64, dtype=torch.int8)
        factors, mean = torch.empty(numel // 64 // 256 + 1, dtype=torch.bfloat16), torch.empty((), dtype=torch.bfloat16)
        torch.ops.hone.nf4_linear(x, packed, scalers, factors, mean, 64, 256, n_out, n_in)

    assert _counted(nf4) == 2 * 10 * n_in * n_out


def test_the_budget_context_keeps_hones_ops_out_of_free_recomputation_and_restores_the_config():
    before = (functorch_config.activation_memory_budget, functorch_config.is_non_builtin_to_include)
    with memory_budget_context(0.3):
        assert functorch_config.activation_memory_budget == 0.3
        assert functorch_config.is_non_builtin_to_include is True
    assert (functorch_config.activation_memory_budget, functorch_config.is_non_builtin_to_include) == before
