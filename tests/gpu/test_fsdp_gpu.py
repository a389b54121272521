"""FSDP2 on 2 GPUs (NCCL), bf16, regional compile (Inductor) and full checkpointing: the summed
gradients of 2 ranks x 1 micro-batch are as close to a float32 one-GPU run as one GPU's own bf16
accumulated gradients are (bf16 rounding alone puts a LoRA A gradient several percent off, so a
fixed bound against the bf16 run cannot tell rounding from a wrong reduction; a lost or doubled
rank's share puts the sharded run tens of percent off).

Run: pytest -q -m gpu tests/gpu/test_fsdp_gpu.py (needs >= 2 CUDA devices; skips otherwise).
"""

import os
import socket
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs >= 2 CUDA devices"),
]

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))


def _cfg(tmp, adapter: str):
    from hone.testing import tiny_config

    sections = {
        "model": {"preset": "tiny-llama", "dtype": "bfloat16"},
        "distributed": {"strategy": "fsdp"},
        "memory": {"activation_checkpointing": "full"},
        "performance": {"torch_compile": True, "loss": "standard"},
    }
    if adapter == "lora":
        sections["adapter"] = {"type": "lora", "lora_r": 8, "lora_target_modules": "all-linear"}
    return tiny_config(tmp, **sections)


def _model(adapter: str, device, dtype: str = "bfloat16"):
    from hone.models.precision import cast_trainable, precision_for
    from hone.testing import tiny_model, tiny_tokenizer, with_random_lora

    torch.manual_seed(11)
    model = tiny_model("tiny-llama", tiny_tokenizer(), seed=3, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    if adapter == "lora":
        model = with_random_lora(model, seed=4)
    precision = precision_for(dtype, full_finetune=adapter != "lora")
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(precision.weights)
    cast_trainable(model, precision.trainable)
    return model.to(device), precision


def _window():
    from hone.data.collate import collate
    from hone.testing import random_rows

    rows = random_rows(4, seed=5, vocab=300, min_len=200, max_len=256, as_list=True)
    return [collate(rows[0:2], pad_id=0), collate(rows[2:4], pad_id=0)]


def _worker(rank: int, port: int, tmp: Path, adapter: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    from hone.train.distributed import close_world, device_of, init_world
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    world = init_world("cuda")
    try:
        device = device_of(world, "cuda")
        cfg = _cfg(tmp, adapter)
        facts = RunFacts(device, world=world)
        plan = plan_optimizations(cfg, facts)
        model, precision = _model(adapter, device)
        plan.apply(model, "base", cfg, facts)
        plan.apply(model, "adapted", cfg, facts)
        assert [a.name for a in plan.in_order()][-2:] == ["compile", "fsdp"]
        hooks = plan.hooks(model, cfg, facts)
        window = _window()
        tokens = sum(b.trained_tokens for b in window)
        batch = window[rank].to(device).with_attention(hooks.layout)
        (hooks.step_module(model, precision.autocast_dtype).module(batch) / tokens).backward()
        grads = {n: p.grad.full_tensor().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        if rank == 0:
            torch.save(grads, tmp / "sharded.pt")
    finally:
        close_world()


@pytest.mark.parametrize("adapter", ["lora", "none"])
def test_fsdp_bf16_compile_checkpointing_matches_one_gpu(tmp_path, adapter):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, tmp_path, adapter), nprocs=2, join=True)
    sharded = torch.load(tmp_path / "sharded.pt")

    device = torch.device("cuda", 0)
    one_gpu_bf16 = _one_gpu_grads(adapter, device, "bfloat16")
    float32 = _one_gpu_grads(adapter, device, "float32")
    assert set(sharded) == set(float32) == set(one_gpu_bf16)
    for name, want in float32.items():
        assert torch.isfinite(sharded[name]).all()
        rounding = _relative(one_gpu_bf16[name], want)
        err = _relative(sharded[name], want)
        assert err <= 2 * rounding + 1e-2, f"{name}: {err:.3e} off float32 (one GPU in bf16: {rounding:.3e})"


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def _one_gpu_grads(adapter: str, device, dtype: str) -> dict[str, torch.Tensor]:
    """The whole window accumulated on one GPU, eager, no checkpointing."""
    from hone.testing import run_hooks

    model, precision = _model(adapter, device, dtype)
    hooks = run_hooks(model, device="cuda")
    window = _window()
    tokens = sum(b.trained_tokens for b in window)
    for batch in window:
        batch = batch.to(device).with_attention(hooks.layout)
        (hooks.step_module(model, precision.autocast_dtype).module(batch) / tokens).backward()
    return {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
