"""MXFP4 experts under DDP on 2 gloo processes: the placeholders (one element viewed at the
weight's shape) and the blocks and scales are left out of DDP's broadcast at wrap time (writing
into a placeholder is an error; the blocks of a real model are gigabytes), and the expert LoRA
gradients are summed over the ranks exactly as one process computes them. The experts run the
float32 reference on the CPU."""

import torch
from fsdp_harness import full, save, spawn

WORLD = 2
VOCAB = 256


def _model():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hone.models.experts import experts_modules, set_experts_implementation
    from hone.models.experts.lora import register_fused_expert_lora
    from hone.models.experts.mxfp4 import quantize_experts
    from hone.models.presets import build_preset_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_preset_config("tiny-qwen3-moe", {}, VOCAB), dtype=torch.float32)
    for _, module in experts_modules(model):
        quantize_experts(module, torch.device("cpu"))
    set_experts_implementation(model, "hone")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["gate_up_proj", "down_proj"])
    config.init_lora_weights = False  # random B too: every factor gets a gradient
    register_fused_expert_lora(config, model)
    return get_peft_model(model, config)


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(10 + rank))


def _loss(module, ids: torch.Tensor) -> torch.Tensor:
    return module(input_ids=ids, labels=ids).loss


def _ddp(rank: int, out) -> None:
    from hone.models.experts.mxfp4 import is_placeholder
    from hone.runtime.step import StepModule
    from hone.transforms.data_parallel import wrap_ddp

    model = _model()
    step = wrap_ddp(StepModule(model))
    _loss(step.module, _ids(rank)).backward()
    placeholders = [p for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))]
    assert placeholders and all(is_placeholder(p) for p in placeholders)
    if rank == 0:
        save({n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}, out)


def test_ddp_sums_expert_lora_gradients_over_an_mxfp4_base(tmp_path):
    out = tmp_path / "ddp.pt"
    spawn(_ddp, WORLD, out, timeout_s=180)
    got = torch.load(out)
    model = _model()
    for rank in range(WORLD):
        _loss(model, _ids(rank)).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want) and any("experts" in n and "lora_B" in n for n in want), sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
