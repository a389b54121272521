"""Expert parallelism with hone's grouped kernels on CUDA (fp32, IEEE dots: <= 1e-4).

One GPU: the rank's local experts through the grouped kernels, on received rows of which a
share are sentinels (zero rows, local id ``E / N``), equal the plain-PyTorch path: output and
the gradients of the rows (real rows; a sentinel row's gradient is discarded by the sender),
the LoRA factors, and (full fine-tune) the expert weights and biases; with no sentinel, some,
and only sentinels (an idle rank). Two GPUs (NCCL): the cases of the gloo test
(tests/distributed/expert_parallel_cases.py) through the kernels equal the single-process
reference. Skipped without a GPU (or without two).

Run on the GPU machine:  python -m pytest -q -m gpu tests/gpu/test_expert_parallel_gpu.py
"""

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from expert_parallel_cases import CASES, SMALL_CAPACITY, TOKENS, WORLD, compare, rank_results  # noqa: E402

from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE  # noqa: E402
from hone.parallel.expert_parallel import LocalExperts, local_experts  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROWS, HIDDEN, INTER, LOCAL, RANK = 512, 256, 128, 8, 16
DEVICE = "cuda"


def _local_case(layout, sentinel_share: float, seed: int = 0) -> tuple[dict, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape, std=1.0: torch.randn(*shape, generator=gen) * std  # noqa: E731
    ids = torch.randint(0, LOCAL, (ROWS,), generator=gen)
    ids[ids == 3] = 4  # expert 3 gets no row
    ids[torch.rand(ROWS, generator=gen) < sentinel_share] = LOCAL
    rows = rand(ROWS, HIDDEN) * (ids != LOCAL).unsqueeze(1)  # sentinel rows arrive as zeros
    if layout.transposed:
        gate_up, down = rand(LOCAL, HIDDEN, 2 * INTER, std=0.1), rand(LOCAL, INTER, HIDDEN, std=0.1)
    else:
        gate_up, down = rand(LOCAL, 2 * INTER, HIDDEN, std=0.1), rand(LOCAL, HIDDEN, INTER, std=0.1)
    bias = layout is GPT_OSS
    tensors = dict(
        rows=rows,
        cotangent=rand(ROWS, HIDDEN),
        gate_up=gate_up,
        down=down,
        gate_up_bias=rand(LOCAL, 2 * INTER) if bias else None,
        down_bias=rand(LOCAL, HIDDEN) if bias else None,
        gu_A=rand(LOCAL, RANK, HIDDEN, std=0.1),
        gu_B=rand(LOCAL, 2 * INTER, RANK, std=0.1),
        dn_A=rand(LOCAL, RANK, INTER, std=0.1),
        dn_B=rand(LOCAL, HIDDEN, RANK, std=0.1),
    )
    return tensors, ids


def _run(tensors: dict, ids: torch.Tensor, layout, trained: str, use_kernels: bool) -> dict:
    train = {"rows"} | (
        {"gu_A", "gu_B", "dn_A", "dn_B"} if trained == "lora" else {"gate_up", "down", "gate_up_bias", "down_bias"}
    )
    inputs = {n: v for n, v in tensors.items() if n != "cotangent"}
    t = {n: None if v is None else v.to(DEVICE).clone().requires_grad_(n in train) for n, v in inputs.items()}
    lora = trained == "lora"
    experts = LocalExperts(
        t["gate_up"], t["down"], layout, t["gate_up_bias"], t["down_bias"],
        (t["gu_A"], t["gu_B"]) if lora else None, (t["dn_A"], t["dn_B"]) if lora else None, 0.5, 0.25,
    )  # fmt: skip
    y = local_experts(t["rows"], ids.to(DEVICE), experts, use_kernels=use_kernels)
    (y * tensors["cotangent"].to(DEVICE)).sum().backward()
    got = {"out": y.detach()}
    got.update({n: v.grad for n, v in t.items() if v is not None and v.grad is not None})
    return got


@pytest.mark.parametrize("sentinel_share", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("trained", ["lora", "full"])
@pytest.mark.parametrize("layout_name", ["qwen3_moe", "gpt_oss"])
def test_grouped_local_experts_skip_sentinels_like_the_plain_path(layout_name, trained, sentinel_share):
    layout = QWEN3_MOE if layout_name == "qwen3_moe" else GPT_OSS
    tensors, ids = _local_case(layout, sentinel_share)
    want = _run(tensors, ids, layout, trained, use_kernels=False)
    got = _run(tensors, ids, layout, trained, use_kernels=True)
    real = (ids != LOCAL).to(DEVICE)
    want["rows"], got["rows"] = want["rows"][real], got["rows"][real]  # a sentinel row's gradient is discarded
    assert set(got) == set(want)
    assert got["out"][~real].abs().sum().item() == 0  # sentinel rows: zero
    for name, expected in want.items():
        assert torch.isfinite(got[name]).all(), name
        if expected.numel() == 0 or expected.abs().sum() == 0:
            assert got[name].abs().sum().item() == 0, name
            continue
        err = ((got[name] - expected).norm() / expected.norm()).item()
        assert err <= 1e-4, f"{name}: relative error {err:.2e}"
    if trained == "full":
        assert got["gate_up"][3].abs().sum().item() == 0  # the expert with no row


def test_one_layer_runs_without_a_host_sync():
    """Dispatch, the grouped local experts and the combine, forward and backward, with sentinel
    slots (a capacity past ``T * k``), under CUDA's sync debug mode once the kernels are compiled."""
    from hone.parallel.expert_parallel import ExpertShard, expert_parallel_experts

    layout = QWEN3_MOE
    tensors, _ = _local_case(layout, 0.0)
    shard = ExpertShard(size=1, rank=0, num_experts=LOCAL)
    hidden = torch.randn(128, HIDDEN, device=DEVICE, requires_grad=True)
    index = torch.rand(128, LOCAL, device=DEVICE).argsort(dim=1)[:, :4]
    weights = torch.rand(128, 4, device=DEVICE, requires_grad=True)
    lora = [tensors[n].to(DEVICE).requires_grad_() for n in ("gu_A", "gu_B", "dn_A", "dn_B")]
    gate_up, down = tensors["gate_up"].to(DEVICE), tensors["down"].to(DEVICE)

    def step() -> torch.Tensor:
        out, overflow = expert_parallel_experts(
            hidden, index, weights, gate_up, down, layout, shard, lora=((lora[0], lora[1]), (lora[2], lora[3])),
            capacity=128 * 4 + 64, use_kernels=True,
        )  # fmt: skip
        out.square().sum().backward()
        return overflow

    step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        overflow = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert overflow.item() == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nccl_worker(rank: int, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    from hone.train.distributed import close_world, init_world

    init_world("cuda")
    try:
        torch.save(rank_results(rank, device=f"cuda:{rank}", use_kernels=True), out / f"{rank}.pt")
    finally:
        close_world()


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA GPUs")
def test_two_gpus_through_the_grouped_kernels_equal_the_reference(tmp_path):
    mp.start_processes(_nccl_worker, args=(_free_port(), tmp_path), nprocs=WORLD, start_method="spawn")
    ranks = [torch.load(tmp_path / f"{rank}.pt") for rank in range(WORLD)]
    problems = [problem for name in CASES for problem in compare(ranks, name, tolerance=1e-4)]
    assert problems == []
    for results in ranks:
        assert results["qwen3_moe-skewed"]["small_overflow"] == 2 * TOKENS - SMALL_CAPACITY
        assert "refused" in results["qwen3_moe-skewed"]
