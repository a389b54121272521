"""Expert parallelism with hone's grouped kernels on CUDA (fp32, IEEE dots: <= 1e-4).

One GPU: the rank's local experts through the grouped kernels, on received token rows whose
choices are partly held elsewhere (local id ``E / N``), equal the plain-PyTorch path at real
sizes (tests/kernels/expert_local_checks.py): output and the gradients of the rows (real rows;
a sentinel slot's gradient is discarded by the sender), the routing weights, the LoRA factors,
and (full fine-tune) the expert weights and biases; with no sentinel, some, and only sentinels
(an idle rank); the same for MXFP4 experts through the grouped MXFP4 kernels
(tests/kernels/expert_local_mxfp4_checks.py). Two GPUs (NCCL): the cases of the gloo test
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
from expert_parallel_cases import CASES, RECOMPUTED, SMALL_CAPACITY, TOKENS, TOP_K, WORLD, compare, rank_results  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from expert_local_checks import local_case, relative_errors  # noqa: E402
from expert_local_mxfp4_checks import mxfp4_relative_errors  # noqa: E402

from hone.kernels.moe_lora_reference import QWEN3_MOE  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"


@pytest.mark.parametrize("sentinel_share", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("trained", ["lora", "full"])
@pytest.mark.parametrize("layout_name", ["qwen3_moe", "gpt_oss"])
def test_grouped_local_experts_skip_sentinels_like_the_plain_path(layout_name, trained, sentinel_share):
    errors = relative_errors(layout_name, trained, sentinel_share, DEVICE)
    assert errors.pop("sentinel_out") == 0.0 and errors.pop("overflow") == 0
    bad = {name: err for name, err in errors.items() if isinstance(err, str) or err > 1e-4}
    assert not bad, bad


@pytest.mark.parametrize("sentinel_share", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("layout_name", ["qwen3_moe", "gpt_oss"])
def test_grouped_mxfp4_local_experts_skip_sentinels_like_the_dequantized_reference(layout_name, sentinel_share):
    """MXFP4 experts: the grouped MXFP4 kernels on the rank's block against the float32 path on the
    dequantized block (LoRA, and gpt-oss' biases, trained; the base frozen), at real sizes."""
    errors = mxfp4_relative_errors(layout_name, sentinel_share, DEVICE)
    assert errors.pop("sentinel_out") == 0.0 and errors.pop("overflow") == 0
    bad = {name: err for name, err in errors.items() if isinstance(err, str) or err > 1e-4}
    assert not bad, bad


def test_one_layer_runs_without_a_host_sync():
    """Dispatch, the grouped local experts and the combine, forward and backward, with sentinel
    token slots (160 for 128 tokens) and pair rows (a capacity of 576 for 512 pairs), under
    CUDA's sync debug mode once the kernels are compiled."""
    from hone.parallel.expert_parallel import ExpertShard, expert_parallel_experts

    layout = QWEN3_MOE
    tensors = local_case(layout, 0.0)
    local, hidden_size = tensors["gate_up"].shape[0], tensors["rows"].shape[1]
    shard = ExpertShard(size=1, rank=0, num_experts=local)
    hidden = torch.randn(128, hidden_size, device=DEVICE, requires_grad=True)
    index = torch.rand(128, local, device=DEVICE).argsort(dim=1)[:, :4]
    weights = torch.rand(128, 4, device=DEVICE, requires_grad=True)
    lora = [tensors[n].to(DEVICE).requires_grad_() for n in ("gu_A", "gu_B", "dn_A", "dn_B")]
    gate_up, down = tensors["gate_up"].to(DEVICE), tensors["down"].to(DEVICE)

    def step() -> torch.Tensor:
        out, overflow = expert_parallel_experts(
            hidden, index, weights, gate_up, down, layout, shard, lora=((lora[0], lora[1]), (lora[2], lora[3])),
            capacity=128 * 4 + 64, use_kernels=True, max_tokens=160,
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
    names = [*CASES, *(f"{name}/{variant}" for name in CASES for variant in RECOMPUTED)]
    problems = [problem for name in names for problem in compare(ranks, name, tolerance=1e-4)]
    assert problems == []
    every_pair = WORLD * TOKENS * TOP_K  # all on rank 1
    assert [results["qwen3_moe-skewed"]["small_overflow"] for results in ranks] == [0, every_pair - SMALL_CAPACITY]
    assert all("refused" in results["qwen3_moe-skewed"] for results in ranks)


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA GPUs")
def test_a_run_that_records_the_exchanges_in_cuda_graphs_trains_and_exits(tmp_path):
    """``hone train`` on 2 GPUs with expert parallelism and CUDA graphs (``auto``'s choice beside
    DDP): the graphs record NCCL all-to-alls, and the processes must still exit. A live graph
    holding NCCL kernels blocks ``destroy_process_group`` forever (pytorch/pytorch#115388), so
    hone drops the graphs first; without that this launch times out after training."""
    import json
    import subprocess

    from dist_launch import TIMEOUT_S, child_env, tiny_moe_train_config, torchrun

    data = tmp_path / "same_length.jsonl"  # one micro-batch shape: graphs record once (18 tokens of the bundled tokenizer)
    data.write_text("".join(json.dumps({"text": "red green blue lemon lime fox " * 2}) + "\n" for _ in range(16)))
    cfg = tiny_moe_train_config(
        tmp_path,
        {"max_steps": 4, "micro_batch_size": 1},
        {"expert_parallel": WORLD},
        data={
            "datasets": [{"path": str(data), "type": "completion"}],
            "sequence_len": 32,
            "dataset_prepared_path": str(tmp_path / "c"),
        },
        performance={"cuda_graphs": True},
    )
    done = subprocess.run(
        torchrun("-m", "hone", "train", str(cfg), nproc=WORLD),
        env=child_env(CUDA_VISIBLE_DEVICES="0,1"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "CUDA graphs" in done.stdout and "expert parallel (2 ranks" in done.stdout
    assert (tmp_path / "run" / "final").is_dir()


def _compiled_worker(rank: int, port: int, out: Path) -> None:
    """The LoRA case through the grouped kernels and NCCL, eager and compiled by Inductor
    (fullgraph: the exchanges inside the graph, as in a compiled decoder layer)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    from expert_parallel_cases import DOWN_SCALING, EXPERTS, SCALING, grads_of, leaves, lora_of, make_case

    from hone.parallel.expert_parallel import ExpertShard, expert_parallel_experts
    from hone.train.distributed import close_world, init_world

    init_world("cuda")
    try:
        shard = ExpertShard.of_group(EXPERTS)
        case = make_case("qwen3_moe-lora")
        tokens = slice(rank * TOKENS, (rank + 1) * TOKENS)
        index = case["index"][tokens].to(DEVICE)
        got = {}
        for mode in ("eager", "compiled"):
            t = leaves(case, lambda key, v: v[tokens] if key in ("hidden", "weights") else shard.local(v), DEVICE)

            def experts(hidden, weights, t=t):
                return expert_parallel_experts(
                    hidden, index, weights, t["gate_up_proj"], t["down_proj"], case["layout"], shard,
                    lora=lora_of(t), scaling=SCALING, down_scaling=DOWN_SCALING, use_kernels=True,
                )  # fmt: skip

            run = experts if mode == "eager" else torch.compile(experts, backend="inductor", fullgraph=True)
            result, _ = run(t["hidden"], t["weights"])
            (result * case["cotangent"][tokens].to(DEVICE)).sum().backward()
            got[mode] = {"out": result.detach().cpu(), "grads": grads_of(t)}
        torch.save(got, out / f"compiled-{rank}.pt")
    finally:
        close_world()


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA GPUs")
def test_two_gpus_compiled_through_the_grouped_kernels_equal_eager(tmp_path):
    """Inductor's graph of the exchanges and the grouped kernels on NCCL gives eager's output and
    every gradient (hidden, routing weights, the experts' LoRA factors; none missing, none zero):
    the compiled step differentiates through the NCCL exchanges (hone's earlier exchange, an
    autograd Function filling ``torch.empty_like`` with ``all_to_all_single``, was differentiated
    as zero by torch 2.11, as in DeepSpeed PR 8491; hone/parallel/exchange.py)."""
    mp.start_processes(_compiled_worker, args=(_free_port(), tmp_path), nprocs=WORLD, start_method="spawn")
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"compiled-{rank}.pt")
        eager, compiled = got["eager"], got["compiled"]
        assert set(eager["grads"]) == set(compiled["grads"]) == {"hidden", "weights", "gu_A", "gu_B", "dn_A", "dn_B"}
        torch.testing.assert_close(compiled["out"], eager["out"], rtol=1e-4, atol=1e-4)
        for name, want in eager["grads"].items():
            have = compiled["grads"][name]
            assert have.abs().sum() > 0, (rank, name)
            torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"rank {rank} {n}: {m}")
