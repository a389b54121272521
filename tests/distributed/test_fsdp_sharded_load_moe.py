"""The sharded load (FSDP2, each rank reading its rows) of a Hugging Face MoE checkpoint: one
tensor per expert (what transformers 5's save_pretrained writes for qwen3-moe) or the experts
already fused, each also with expert parallelism beside FSDP2 (each rank reading its block of
experts), equals a normal load: every weight, and the loss of a batch."""

import math

import pytest
import torch
from fsdp_harness import full, load_sharded_as_planned, save, spawn
from safetensors import safe_open


def _cfg(tmp, model_dir, expert_parallel: int, adapter: str):
    from hone.testing import tiny_config

    sections = {
        "model": {"preset": None, "path": str(model_dir), "dtype": "float32"},
        "distributed": {"strategy": "fsdp"} | ({"expert_parallel": expert_parallel} if expert_parallel > 1 else {}),
        "performance": {"loss": "standard"},
    }
    if adapter == "lora":
        sections["adapter"] = {"type": "lora", "lora_r": 4, "lora_target_modules": "all-linear"}
    return tiny_config(tmp, **sections)


def _batch():
    from hone.data.collate import collate
    from hone.testing import random_rows

    return collate(random_rows(2, seed=9, vocab=300, as_list=True), pad_id=0)


def _sharded(rank: int, tmp, model_dir, expert_parallel: int, adapter: str, out) -> None:
    from torch.distributed.tensor import DTensor

    from hone.models.experts.parallel import expert_shard

    cfg = _cfg(tmp, model_dir, expert_parallel, adapter)
    loaded, plan, facts = load_sharded_as_planned(cfg)
    model = loaded.model
    firsts = {}  # the expert blocks FSDP2 leaves local: their first expert
    for module_name, module in model.named_modules():
        shard = expert_shard(module)
        for name, param in module.named_parameters(prefix=module_name, recurse=False):
            assert isinstance(param, DTensor) or shard is not None, name
            if shard is not None:
                firsts[name] = shard.first
    hooks = plan.hooks(model, cfg, facts)
    with torch.no_grad():
        loss = float(hooks.step_module(model).module(_batch()))
    weights = {n: full(p) for n, p in model.named_parameters()}
    save({"weights": weights, "firsts": firsts, "loss": loss}, out / f"rank{rank}.pt")


def _fuse_checkpoint(model_dir) -> None:
    """Rewrite the checkpoint with the experts fused, as transformers 5 holds them."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "layout,expert_parallel,adapter",
    [("per-expert", 1, "none"), ("fused", 1, "none"), ("per-expert", 2, "none"), ("fused", 2, "none"), ("per-expert", 2, "lora")],
)
def test_sharded_load_of_a_moe_checkpoint_equals_normal_load(tmp_path, layout, expert_parallel, adapter):
    from hone.models.loader import load_model
    from hone.models.tokenizer import load_tokenizer
    from hone.testing import run_hooks, save_tiny_model, tiny_tokenizer

    model_dir = save_tiny_model(tmp_path / "model", "tiny-qwen3-moe", tiny_tokenizer(), seed=5)
    if layout == "fused":
        _fuse_checkpoint(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        fused = any(k.endswith("mlp.experts.gate_up_proj") for k in f.keys())
        assert fused == (layout == "fused")
        assert fused or "model.layers.0.mlp.experts.7.up_proj.weight" in f.keys()
    spawn(_sharded, 2, tmp_path, model_dir, expert_parallel, adapter, tmp_path, timeout_s=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]

    cfg = _cfg(tmp_path, model_dir, 1, adapter)
    torch.manual_seed(0)
    ref = load_model(cfg, load_tokenizer(cfg.model), "cpu")
    want = {n: p.detach() for n, p in ref.model.named_parameters()}
    experts = [n for n in want if n.endswith(("gate_up_proj", "down_proj"))]
    assert experts
    for got in ranks:
        assert set(got["weights"]) == set(want)
        assert set(got["firsts"]) == (set(experts) if expert_parallel > 1 else set())
        for name, value in want.items():
            first = got["firsts"].get(name)
            if first is not None:  # the rank's block of experts
                value = value[first : first + got["weights"][name].shape[0]]
            assert torch.equal(got["weights"][name], value), name
    if expert_parallel > 1:
        assert [got["firsts"][experts[0]] for got in ranks] == [0, want[experts[0]].shape[0] // 2]
    with torch.no_grad():
        loss = float(run_hooks(ref.model).step_module(ref.model).module(_batch()))
    assert math.isclose(ranks[0]["loss"], loss, rel_tol=1e-5)
