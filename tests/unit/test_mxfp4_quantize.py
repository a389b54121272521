"""``model.quantize: mxfp4`` (the experts of any MoE base in MXFP4) and MXFP4 checkpoints in the
plan: the config's refusals, the quantize transform on CPU (tiny presets, and a big preset's
as-drawn path), the experts backend it forces, and the memory the plan counts.

Parity is against the same model with its experts dequantized (exact float32 values of the MXFP4
codes) under transformers' eager experts: quantizing must change nothing but the storage."""

import copy

import pytest
import torch

from hone.config import parse_config
from hone.errors import HoneError
from hone.models.experts.backend import experts_modules, set_experts_implementation
from hone.models.experts.mxfp4 import MXFP4_BYTES_PER_WEIGHT, dequantize_model_experts, has_mxfp4_experts, mxfp4_weights
from hone.models.loader import build_base_model
from hone.testing import tiny_tokenizer
from hone.transforms.base import RunFacts
from hone.transforms.planner import plan_optimizations

CPU = RunFacts(torch.device("cpu"))


def _raw(tmp_path, preset="tiny-qwen3-moe", **extra):
    raw = {
        "model": {"preset": preset, "dtype": "float32", "quantize": "mxfp4"},
        "data": {"datasets": [{"path": "unused.jsonl", "type": "pretokenized"}], "sequence_len": 32},
        "adapter": {"type": "lora", "lora_r": 4, "lora_target_modules": ["q_proj", "v_proj", "experts"]},
        "training": {"output_dir": str(tmp_path)},
    }
    for section, values in extra.items():  # adapter: replaced whole (a full fine-tune takes no lora_* keys)
        raw[section] = values if section == "adapter" else {**raw.get(section, {}), **values}
    return raw


def _cfg(tmp_path, preset="tiny-qwen3-moe", **extra):
    return parse_config(_raw(tmp_path, preset, **extra))


def test_config_refuses_full_finetune_fsdp_fp8_and_transformers_experts(tmp_path):
    with pytest.raises(HoneError, match=r"'mxfp4' stores the experts' weights in 4 bits.*adapter.type: lora"):
        _cfg(tmp_path, adapter={"type": "none"})
    with pytest.raises(HoneError, match=r"'mxfp4' does not work with distributed.strategy: fsdp.*4-bit experts"):
        _cfg(tmp_path, distributed={"strategy": "fsdp"})
    with pytest.raises(HoneError, match=r"'mxfp4' and performance.fp8: rowwise.*choose one"):
        _cfg(tmp_path, model={"dtype": "bfloat16"}, performance={"fp8": "rowwise"})
    for value in ("eager", "grouped_mm"):
        with pytest.raises(HoneError, match=rf"mxfp4 runs the MXFP4 experts in hone's kernels.*is '{value}'.*auto, hone"):
            _cfg(tmp_path, model={"experts_implementation": value})
    assert _cfg(tmp_path, model={"experts_implementation": "hone"}).model.quantize == "mxfp4"


def test_config_refuses_mxfp4_on_a_dense_preset_naming_it(tmp_path):
    with pytest.raises(HoneError, match=r"model.preset 'tiny-llama' has no experts.*tiny-gpt-oss"):
        _cfg(tmp_path, preset="tiny-llama")


def test_nf4_messages_still_read_for_the_whole_base(tmp_path):
    pytest.importorskip("torchao")
    with pytest.raises(HoneError, match=r"'nf4' stores the base weights in 4 bits"):
        _cfg(tmp_path, model={"quantize": "nf4"}, adapter={"type": "none"})


def _reference(base):
    """``base`` with its experts dequantized to float32 under transformers' eager experts."""
    reference = copy.deepcopy(base)
    assert dequantize_model_experts(reference, torch.float32) == len(experts_modules(base))
    set_experts_implementation(reference, "eager")
    return reference


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-gpt-oss"])
def test_plan_quantizes_every_experts_module_and_the_logits_equal_the_dequantized_models(tmp_path, preset):
    cfg = _cfg(tmp_path, preset)
    plan = plan_optimizations(cfg, CPU)
    assert plan.names[:3] == ["attention", "quantize", "experts"]
    assert plan.decided.experts_implementation == "hone" and "float32 reference" in plan.decided.experts_why
    base = build_base_model(cfg.model, tiny_tokenizer(), torch.device("cpu"), torch.float32, seed=0)
    full = {n: p.clone() for n, p in base.named_parameters()}
    applied = {a.name: a.details for a in plan.apply(base, "base", cfg, CPU)}
    modules = experts_modules(base)
    assert applied["quantize"]["format"] == "mxfp4" and applied["quantize"]["experts_modules"] == len(modules) == 2
    assert all(set(mxfp4_weights(m)) == {"gate_up_proj", "down_proj"} for _, m in modules)
    weights = sum(full[f"{name}.{p}"].numel() for name, _ in modules for p in ("gate_up_proj", "down_proj"))
    assert applied["quantize"]["experts_weights"] == weights
    for name, p in base.named_parameters():  # attention, router, norms, embedding, head: untouched
        if not name.endswith(("gate_up_proj", "down_proj")) or ".experts." not in name:
            assert torch.equal(p, full[name]), name
    assert "quantize (mxfp4: 2 experts modules" in plan.describe()
    reference = _reference(base)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, expected = base(input_ids=ids).logits, reference(input_ids=ids).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    full_model = build_base_model(cfg.model, tiny_tokenizer(), torch.device("cpu"), torch.float32, seed=0)
    with torch.no_grad():
        assert (full_model(input_ids=ids).logits - logits).abs().max() > 0  # 4 bits changed the experts


def test_plan_refuses_mxfp4_for_a_dense_model_directory(tmp_path):
    from hone.models.presets import build_preset_config

    model_dir = tmp_path / "dense"
    build_preset_config("llama3-8b", {"num_hidden_layers": 2}, None).save_pretrained(model_dir)
    raw = _raw(tmp_path)
    raw["model"] = {"path": str(model_dir), "dtype": "float32", "quantize": "mxfp4"}
    raw["adapter"]["lora_target_modules"] = ["q_proj", "v_proj"]
    with pytest.raises(HoneError, match=rf"model.quantize: mxfp4 .* but {model_dir} has no MoE layers"):
        plan_optimizations(parse_config(raw), CPU)


def test_dense_model_given_to_the_transform_is_a_clear_error(tmp_path):
    from hone.models.experts.mxfp4_quantize import quantize_experts_as_drawn, quantize_model_experts

    dense = build_base_model(
        _cfg(tmp_path).model.model_copy(update={"preset": "tiny-llama"}), tiny_tokenizer(), "cpu", torch.float32, 0
    )
    with pytest.raises(HoneError, match=r"model.quantize: mxfp4 .* LlamaForCausalLM has no experts module"):
        quantize_model_experts(dense, "cpu")
    with pytest.raises(HoneError, match="has no experts module"):
        quantize_experts_as_drawn(dense)


def test_big_preset_quantizes_each_experts_module_as_it_is_drawn(tmp_path):
    """A non-tiny preset at toy shapes, drawn module by module on the CPU: every experts module is
    in MXFP4 as soon as it is drawn, so no two layers' full-precision experts ever coexist; the
    result is the ordinary build's draws, quantized."""
    from hone.models.experts.mxfp4_quantize import quantize_experts_as_drawn
    from hone.models.materialize import build_skeleton, materialize
    from hone.models.presets import build_preset_config

    overrides = {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    overrides |= {"vocab_size": 512, "head_dim": 16, "intermediate_size": 32, "num_local_experts": 4}
    raw = _raw(tmp_path, "gpt-oss-20b", model={"preset_overrides": overrides})
    cfg = parse_config(raw)
    tokenizer = tiny_tokenizer()
    skeleton = build_skeleton(build_preset_config("gpt-oss-20b", overrides, len(tokenizer)), torch.float32)
    replace, full_experts = quantize_experts_as_drawn(skeleton), []

    def spy(module):
        result = replace(module)
        full_experts.append(sum(not mxfp4_weights(m) and not m.gate_up_proj.is_meta for _, m in experts_modules(skeleton)))
        return result

    torch.manual_seed(0)
    materialize(skeleton, "cpu", spy)
    assert max(full_experts) == 0 and has_mxfp4_experts(skeleton)

    plan = plan_optimizations(cfg, CPU)
    as_drawn = build_base_model(
        cfg.model, tokenizer, torch.device("cpu"), torch.float32, seed=3, as_drawn=plan.as_drawn(cfg, CPU)
    )
    full = build_base_model(cfg.model, tokenizer, torch.device("cpu"), torch.float32, seed=3)
    applied = {a.name: a.details for a in plan.apply(as_drawn, "base", cfg, CPU)}  # finds it done, records it
    assert applied["quantize"]["experts_modules"] == 3
    from hone.models.experts.mxfp4 import quantize_experts

    for name, module in experts_modules(full):
        quantize_experts(module, torch.device("cpu"))
        mine = mxfp4_weights(as_drawn.get_submodule(name))
        for proj, (blocks, scales) in mxfp4_weights(module).items():
            assert torch.equal(mine[proj][0], blocks) and torch.equal(mine[proj][1], scales), (name, proj)


def test_plan_counts_mxfp4_experts_at_their_bytes_per_weight(tmp_path):
    """gpt-oss-20b with model.quantize: mxfp4: frozen bytes are the experts' weights at 0.53125
    bytes and every other frozen weight at bf16's 2 (LoRA on attention and experts)."""
    from transformers import AutoModelForCausalLM

    from hone.models.presets import build_preset_config
    from hone.transforms.memory.facts import model_facts

    raw = _raw(tmp_path, "gpt-oss-20b", model={"dtype": "bfloat16"})
    mx = model_facts(parse_config(raw))
    raw["model"]["quantize"] = "none"
    bf16 = model_facts(parse_config(raw))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_preset_config("gpt-oss-20b", {}, None))
    experts = sum(m.gate_up_proj.numel() + m.down_proj.numel() for _, m in experts_modules(model))
    assert experts == 24 * 32 * (2880 * 5760 + 2880 * 2880)  # 19.1 billion
    assert mx.mxfp4_weights == experts and bf16.mxfp4_weights == 0
    assert mx.frozen_params == bf16.frozen_params
    assert bf16.frozen_bytes == 2 * bf16.frozen_params
    assert mx.frozen_bytes == 2 * (mx.frozen_params - experts) + round(experts * MXFP4_BYTES_PER_WEIGHT)
    assert MXFP4_BYTES_PER_WEIGHT == 0.53125 and 13.5e9 < mx.frozen_bytes < 14.0e9  # 10.2 GB of experts, 3.6 of the rest


def test_mxfp4_checkpoint_is_mxfp4_in_the_plan_and_refuses_what_it_cannot_run(tmp_path):
    from hone.transforms.decide import decide
    from hone.transforms.memory.facts import model_facts
    from tests.mxfp4_checkpoint import write_mxfp4_gpt_oss

    model_dir = write_mxfp4_gpt_oss(tmp_path / "gpt-oss").path
    raw = _raw(tmp_path, model={"preset": None, "path": str(model_dir), "quantize": "none"})
    raw["model"].pop("preset")
    cfg = parse_config(raw)
    facts = model_facts(cfg)
    assert facts.mxfp4_checkpoint and facts.mxfp4_weights > 0
    decided = decide(cfg, CPU)
    assert decided.experts_implementation == "hone" and "ships its experts in MXFP4" in decided.experts_why
    plan = plan_optimizations(cfg, CPU)
    assert "quantize" in plan.names
    for model, problem in (
        ({"experts_implementation": "eager"}, r"model.experts_implementation: 'eager' cannot run MXFP4 experts"),
        ({"experts_implementation": "grouped_mm"}, r"model.experts_implementation: 'grouped_mm' cannot run MXFP4 experts"),
    ):
        bad = parse_config({**raw, "model": {**raw["model"], **model}})
        with pytest.raises(HoneError, match=problem):
            plan_optimizations(bad, CPU)
    full = parse_config({**raw, "adapter": {"type": "none"}})
    with pytest.raises(HoneError, match=r"ships its experts in MXFP4.*adapter.type: lora"):
        plan_optimizations(full, CPU)
    if pytest.importorskip("torchao"):
        nf4 = parse_config({**raw, "model": {**raw["model"], "quantize": "nf4"}})
        with pytest.raises(HoneError, match=r"model.quantize: nf4 cannot quantize this base.*none or mxfp4"):
            plan_optimizations(nf4, CPU)


def test_validate_summary_says_the_experts_are_mxfp4(tmp_path):
    from hone.config.summary import summarize

    model_line = summarize(_cfg(tmp_path))[0]
    assert "experts quantized to mxfp4" in model_line
    assert "experts in MXFP4 as shipped" in summarize(_cfg(tmp_path), "experts in MXFP4 as shipped")[0]
