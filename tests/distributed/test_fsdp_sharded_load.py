"""The sharded load (meta-device build, FSDP2 on meta, each rank reading its rows) equals a
normal load: every weight (base and adapter init), the RoPE buffers, and the loss of a batch."""

import math

import pytest
import torch
from fsdp_harness import full, load_sharded_as_planned, save, spawn


def _cfg(tmp, model_dir, adapter: str):
    from hone.testing import tiny_config

    sections = {
        "model": {"preset": None, "path": str(model_dir), "dtype": "float32"},
        "distributed": {"strategy": "fsdp"},
        "performance": {"loss": "standard"},
    }
    if adapter == "lora":
        sections["adapter"] = {"type": "lora", "lora_r": 4, "lora_target_modules": "all-linear"}
    cfg = tiny_config(tmp, **sections)
    return cfg


def _batch():
    from hone.data.collate import collate
    from hone.testing import random_rows

    return collate(random_rows(2, seed=9, vocab=300, as_list=True), pad_id=0)


def _sharded(rank: int, tmp, model_dir, adapter: str, out) -> None:
    cfg = _cfg(tmp, model_dir, adapter)
    loaded, plan, facts = load_sharded_as_planned(cfg)
    model = loaded.model
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    hooks = plan.hooks(model, cfg, facts)
    with torch.no_grad():
        loss = float(hooks.step_module(model).module(_batch()))
    weights = {n: full(p) for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    if rank == 0:
        save({"weights": weights, "buffers": buffers, "loss": loss, "trainable": loaded.trainable_params}, out)


@pytest.mark.parametrize("preset,adapter", [("tiny-llama", "lora"), ("tiny-qwen3", "none")])
def test_sharded_load_equals_normal_load(tmp_path, preset, adapter):
    from hone.models.loader import load_model
    from hone.models.tokenizer import load_tokenizer
    from hone.testing import run_hooks, save_tiny_model, tiny_tokenizer

    model_dir = save_tiny_model(tmp_path / "model", preset, tiny_tokenizer(), seed=5)
    out = tmp_path / "sharded.pt"
    spawn(_sharded, 2, tmp_path, model_dir, adapter, out)
    got = torch.load(out)

    cfg = _cfg(tmp_path, model_dir, adapter)
    torch.manual_seed(0)
    ref = load_model(cfg, load_tokenizer(cfg.model), "cpu")
    want = {n: p.detach() for n, p in ref.model.named_parameters()}
    assert set(got["weights"]) == set(want)
    for name, value in want.items():
        assert torch.equal(got["weights"][name], value), name
    for name, value in ref.model.named_buffers():
        assert torch.equal(got["buffers"][name], value), name
    assert got["trainable"] == ref.trainable_params
    with torch.no_grad():
        loss = float(run_hooks(ref.model).step_module(ref.model).module(_batch()))
    assert math.isclose(got["loss"], loss, rel_tol=1e-6)
    if adapter == "lora":  # the adapter's random init is compared, not just zeros
        assert any("lora_A" in n and want[n].abs().sum() > 0 for n in want)
