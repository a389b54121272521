"""The float32 experts reference against what it stands for: transformers' eager experts
(qwen3_moe and gpt_oss layouts) and PEFT's ``target_parameters`` LoRA on them. If these hold,
the reference's factor shapes are PEFT's, so the Triton path checked against the reference
computes what a saved PEFT adapter means."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE, moe_experts_reference

T, H, I, E, K = 11, 16, 8, 4, 2


class _Holder(nn.Module):
    """PEFT wraps parameters of submodules; the experts module alone is the base model here."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts

    def forward(self, hidden, index, weights):
        return self.experts(hidden, index, weights)


def _experts(kind: str) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K)
        config._experts_implementation = "eager"
        module = Qwen3MoeExperts(config)
        layout = QWEN3_MOE
    else:
        config = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
        config._experts_implementation = "eager"
        module = GptOssExperts(config)
        layout = GPT_OSS
    for p in module.parameters():
        nn.init.normal_(p, std=0.5)
    return module, layout


def _routing(gen):
    # Expert 3 never routed: the reference must skip an empty expert.
    index = torch.stack([torch.randperm(E - 1, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen).softmax(-1)
    return index, weights


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_reference_equals_transformers_eager_experts(kind):
    module, layout = _experts(kind)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(T, H, generator=gen)
    index, weights = _routing(gen)
    expected = module(hidden, index, weights)
    bias = {}
    if kind == "gpt_oss":
        bias = {"gate_up_bias": module.gate_up_proj_bias, "down_bias": module.down_proj_bias}
    got = moe_experts_reference(hidden, index, weights, module.gate_up_proj, module.down_proj, layout, **bias)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_reference_lora_equals_peft_target_parameters(kind):
    module, layout = _experts(kind)
    config = LoraConfig(
        r=4, lora_alpha=8, target_parameters=["experts.gate_up_proj", "experts.down_proj"], init_lora_weights=False
    )
    model = get_peft_model(_Holder(module), config)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(T, H, generator=gen)
    index, weights = _routing(gen)
    expected = model(hidden, index, weights)
    assert not torch.allclose(expected, module(hidden, index, weights))  # the adapter does something

    factors = {}
    scaling = None
    for _name, sub in model.named_modules():
        if hasattr(sub, "parameter_name") and "default" in getattr(sub, "lora_A", {}):
            a = sub.lora_A["default"].weight
            b = sub.lora_B["default"].weight
            factors[sub.parameter_name] = (a.view(E, -1, a.shape[-1]), b.view(b.shape[0], -1, E).permute(2, 0, 1))
            scaling = sub.scaling["default"]
    bias = {}
    if kind == "gpt_oss":
        bias = {"gate_up_bias": module.gate_up_proj_bias, "down_bias": module.down_proj_bias}
    got = moe_experts_reference(
        hidden,
        index,
        weights,
        module.gate_up_proj,
        module.down_proj,
        layout,
        gate_up_lora=factors["gate_up_proj"],
        down_lora=factors["down_proj"],
        scaling=scaling,
        **bias,
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
