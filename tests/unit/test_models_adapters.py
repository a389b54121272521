"""Adapters: what reaches PEFT, and the errors for names that match nothing."""

import pytest
import torch
from peft import PeftModel

from hone.config.adapter import AdapterConfig
from hone.errors import HoneError
from hone.models.adapters import apply_adapter, linear_module_names
from hone.testing import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def lora(model, **settings):
    return apply_adapter(model, AdapterConfig(type="lora", **settings))


def test_settings_reach_peft(tokenizer):
    model = lora(
        tiny_model("tiny-llama", tokenizer),
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.25,
        use_rslora=True,
        lora_target_modules=["q_proj", "down_proj"],
        lora_modules_to_save=["lm_head"],
    )
    assert isinstance(model, PeftModel)
    peft = model.peft_config["default"]
    assert (peft.r, peft.lora_alpha, peft.lora_dropout, peft.use_rslora) == (4, 8, 0.25, True)
    assert set(peft.target_modules) == {"q_proj", "down_proj"}
    assert list(peft.modules_to_save) == ["lm_head"]
    assert peft.task_type == "CAUSAL_LM"
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(8 / 4**0.5)  # rslora: alpha / sqrt(r)
    assert layer.lora_dropout["default"].p == 0.25
    adapted = {n.split(".")[-4] for n, p in model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "down_proj"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lm_head.modules_to_save" in n for n in trainable)
    assert all("lora_" in n or "modules_to_save" in n for n in trainable)


def test_all_linear_adapts_every_linear_but_the_head(tokenizer):
    model = lora(tiny_model("tiny-mistral", tokenizer), lora_target_modules="all-linear")
    adapted = {n.split(".")[-4] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_target_that_matches_nothing_lists_the_linear_modules(tokenizer):
    model = tiny_model("tiny-llama", tokenizer)
    with pytest.raises(HoneError) as info:
        lora(model, lora_target_modules=["q_proj", "v_porj"])
    text = str(info.value)
    assert "adapter.lora_target_modules" in text and "'v_porj' matches no module" in text
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"):
        assert name in text
    assert "all-linear" in text
    assert linear_module_names(model) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    )


def test_a_partial_name_is_not_a_match(tokenizer):
    with pytest.raises(HoneError, match="'proj' matches no module"):
        lora(tiny_model("tiny-llama", tokenizer), lora_target_modules=["proj"])


def test_dotted_suffix_targets_are_accepted(tokenizer):
    model = lora(tiny_model("tiny-qwen3", tokenizer), lora_target_modules=["self_attn.q_proj"])
    assert sum("lora_A" in n for n, _ in model.named_parameters()) == 2  # one per layer


def test_moe_experts_are_adapted_through_peft_target_parameters(tokenizer):
    model = lora(tiny_model("tiny-qwen3-moe", tokenizer), lora_target_modules=["q_proj", "experts"])
    config = model.peft_config["default"]
    assert config.target_modules == {"q_proj"}
    assert config.target_parameters == {"experts.gate_up_proj", "experts.down_proj"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("experts" in n and "lora_A" in n for n in trainable)
    assert not any(n.endswith("gate_up_proj") or n.endswith("experts.down_proj") for n in trainable)  # base frozen


def test_a_single_expert_parameter_can_be_targeted(tokenizer):
    model = lora(tiny_model("tiny-qwen3-moe", tokenizer), lora_target_modules=["q_proj", "gate_up_proj"])
    assert model.peft_config["default"].target_parameters == {"gate_up_proj"}


def test_expert_lora_refuses_dropout_and_says_why(tokenizer):
    with pytest.raises(HoneError) as info:
        lora(tiny_model("tiny-qwen3-moe", tokenizer), lora_target_modules=["experts"], lora_dropout=0.1)
    assert "adapter.lora_dropout" in str(info.value) and "lora_dropout: 0" in str(info.value)


def test_moe_lora_on_attention_leaves_experts_frozen(tokenizer):
    model = lora(tiny_model("tiny-qwen3-moe", tokenizer), lora_target_modules="all-linear")
    adapted = {n.split(".")[-4] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    experts = [p for n, p in model.named_parameters() if "experts" in n]
    assert experts and not any(p.requires_grad for p in experts)


def test_modules_to_save_must_exist(tokenizer):
    with pytest.raises(HoneError) as info:
        lora(tiny_model("tiny-llama", tokenizer), lora_modules_to_save=["output_head"])
    text = str(info.value)
    assert "lora_modules_to_save" in text and "'output_head'" in text and "lm_head" in text


def test_a_module_cannot_be_both_adapted_and_saved(tokenizer):
    with pytest.raises(HoneError, match="both lora_target_modules and lora_modules_to_save"):
        lora(tiny_model("tiny-llama", tokenizer), lora_target_modules=["q_proj", "lm_head"], lora_modules_to_save=["lm_head"])


def test_tied_head_stays_tied_when_saved_in_full(tokenizer):
    model = lora(tiny_model("tiny-qwen3", tokenizer), lora_modules_to_save=["lm_head"])
    assert model.peft_config["default"].ensure_weight_tying
    base = model.get_base_model()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modules_to_save" in name:
                param.add_(1.0)
    assert torch.equal(base.get_input_embeddings().weight, base.get_output_embeddings().weight)


def test_full_finetune_trains_every_weight(tokenizer):
    model = tiny_model("tiny-gemma", tokenizer)
    for param in model.parameters():
        param.requires_grad_(False)
    out = apply_adapter(model, AdapterConfig(type="none"))
    assert out is model
    assert all(p.requires_grad for p in out.parameters())


def test_moe_dense_layer_names_that_peft_would_map_onto_experts_are_refused(tokenizer):
    # decoder_sparse_step=2: layer 0 is a dense MLP (has down_proj), layer 1 is sparse
    model = tiny_model("tiny-qwen3-moe", tokenizer, decoder_sparse_step=2)
    assert any(n.endswith("mlp.down_proj") for n, _ in model.named_modules())
    with pytest.raises(HoneError) as info:
        lora(model, lora_target_modules=["q_proj", "down_proj"])
    assert "['down_proj']" in str(info.value) and "would stay frozen" in str(info.value)
