"""The experts backend's config key, plan check and layout detection (no kernels run here)."""

import os

import pytest
import torch
from pydantic import ValidationError
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from hone.config.model import ModelConfig
from hone.errors import HoneError
from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE
from hone.models.experts import experts_problems, layout_of, set_experts_implementation
from hone.testing import tiny_model, tiny_tokenizer


def test_config_key_is_validated():
    assert ModelConfig(preset="tiny-qwen3-moe").experts_implementation == "auto"
    with pytest.raises(ValidationError, match="experts_implementation"):
        ModelConfig(preset="tiny-qwen3-moe", experts_implementation="scattermoe")


def test_hone_on_a_cpu_run_is_refused_by_the_plan_check(tmp_path):
    from hone.testing import tiny_config
    from hone.transforms.base import PlanContext, RunFacts
    from hone.transforms.decide import decide
    from hone.transforms.experts import EXPERTS

    def ctx(config, facts):
        return PlanContext(config, facts, decide(config, facts))

    cfg = tiny_config(tmp_path, model={"preset": "tiny-qwen3-moe", "experts_implementation": "hone"})
    assert EXPERTS.wanted(ctx(cfg, RunFacts(device=torch.device("cpu"))))
    problems = EXPERTS.check(ctx(cfg, RunFacts(device=torch.device("cpu"))))
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert problems and "CUDA devices only" in problems[0] and "grouped_mm or eager" in problems[0]
    assert not EXPERTS.wanted(
        ctx(tiny_config(tmp_path, model={"preset": "tiny-qwen3-moe"}), RunFacts(device=torch.device("cpu")))
    )


def test_layouts_are_read_from_the_modules():
    qwen = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4))
    gpt = GptOssExperts(GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4))
    assert layout_of(qwen) == QWEN3_MOE
    assert layout_of(gpt) == GPT_OSS


def test_an_activation_the_kernels_lack_is_refused_with_the_module_named():
    config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, hidden_act="gelu")
    module = Qwen3MoeExperts(config)
    with pytest.raises(HoneError, match="Qwen3MoeExperts.*SiLU"):
        layout_of(module)


def test_hone_on_cpu_without_interpreter_is_refused_before_training():
    model = tiny_model("tiny-qwen3-moe", tiny_tokenizer())
    problems = experts_problems(model, torch.device("cpu"))
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert any("CUDA" in p and "grouped_mm or eager" in p for p in problems)


def test_a_dense_model_has_no_experts_to_run():
    problems = experts_problems(tiny_model("tiny-llama", tiny_tokenizer()), torch.device("cuda"))
    assert problems and "no experts module" in problems[0]


def test_transformers_implementations_are_selected_through_the_model():
    model = tiny_model("tiny-qwen3-moe", tiny_tokenizer())
    details = set_experts_implementation(model, "eager")
    assert details == {"implementation": "eager", "experts_modules": 2}
    assert model.config._experts_implementation == "eager"
    with pytest.raises(HoneError, match="not one of: hone, grouped_mm, eager"):
        set_experts_implementation(model, "fast")
