"""The meta-device builder (hone.models.materialize): a big preset drawn one module at a time.

The yardstick is transformers itself: a model built the ordinary way (``from_config``), whose
weights are then drawn again by its own ``initialize_weights()`` from the same seed. The
materialised model must hold the same values bit for bit (fp32, CPU), the buffers the ordinary
constructor computed (RoPE frequencies, Gemma's embedding scale) and compute the same logits."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hone.config.model import ModelConfig
from hone.models.loader import build_base_model, build_preset_model, drawn_on_device
from hone.models.materialize import build_skeleton, materialize
from hone.models.presets import build_preset_config
from hone.testing import tiny_tokenizer

_SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}

#: One small config of every preset family (llama, tied llama, qwen3, qwen3-moe, gpt-oss with YaRN
#: and sinks, gemma3 with its embedding scale and per-layer-type RoPE).
FAMILIES = {
    "llama3-8b": dict(_SMALL, head_dim=16, intermediate_size=64),
    "llama3.2-3b": dict(_SMALL, head_dim=16, intermediate_size=64),
    "qwen3-8b": dict(_SMALL, head_dim=16, intermediate_size=64),
    "qwen3-30b-a3b": dict(_SMALL, intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "gpt-oss-20b": dict(_SMALL, head_dim=16, intermediate_size=32, num_local_experts=4),
    "tiny-gemma": {},
}


def _ordinary_then_reinitialised(config, seed: int):
    """transformers' own build, then its own ``initialize_weights`` from ``seed``; and the
    buffers its constructor computed."""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    for module in model.modules():  # let initialize_weights draw every module again
        module._is_hf_initialized = False
    torch.manual_seed(seed)
    model.initialize_weights()
    return model, buffers


@pytest.mark.parametrize("preset", list(FAMILIES))
def test_materialised_model_equals_transformers_init_from_the_same_seed(preset):
    config = build_preset_config(preset, {} if preset.startswith("tiny") else FAMILIES[preset], 300)
    reference, buffers = _ordinary_then_reinitialised(config, seed=7)
    skeleton = build_skeleton(config, torch.float32)
    assert all(t.is_meta for t in skeleton.state_dict().values())
    torch.manual_seed(7)
    model = materialize(skeleton, "cpu")
    expected, got = reference.state_dict(), model.state_dict()
    assert expected.keys() == got.keys()
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    assert {n for n, _ in model.named_buffers()} == buffers.keys()
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers()), "RoPE / scale buffers recomputed"
    if config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, ref_logits = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, ref_logits)


def _small_big_preset(**extra) -> ModelConfig:
    return ModelConfig(preset="qwen3-8b", preset_overrides={**FAMILIES["qwen3-8b"], **extra})


def test_big_preset_is_drawn_on_the_device_deterministically_by_seed_in_its_dtype():
    tokenizer = tiny_tokenizer()
    cfg = _small_big_preset()
    assert drawn_on_device(cfg) and not drawn_on_device(ModelConfig(preset="tiny-qwen3"))
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_preset_model(cfg, tokenizer, torch.device("cpu"), torch.bfloat16, seed=5)
    assert torch.equal(torch.rand(3), expected_next)  # the caller's random state is left alone
    b = build_preset_model(cfg, tokenizer, torch.device("cpu"), torch.bfloat16, seed=5)
    c = build_preset_model(cfg, tokenizer, torch.device("cpu"), torch.bfloat16, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])
    assert {p.dtype for p in a.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in a.buffers()} == {torch.float32}  # RoPE frequencies stay float32
    for name, p in a.named_parameters():  # the model's own init: normal(0, 0.02) weights, unit norms
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(p.float().std().item() - 0.02) < 0.004 and abs(p.float().mean().item()) < 0.004, name


def _quantizable_big_preset() -> ModelConfig:
    # every projection a multiple of 16,384 weights (NF4's blocks), the head excepted
    return _small_big_preset(hidden_size=128, head_dim=32, num_key_value_heads=4, intermediate_size=256)


def test_quantized_big_preset_never_holds_two_full_precision_linears_and_matches_the_round_trip():
    pytest.importorskip("torchao", reason="NF4 needs the optional 'quant' extra (torchao)")
    import hone.models.nf4 as nf4
    from hone.models.nf4 import NF4Linear, nf4_roundtrip_, quantize_as_drawn, quantize_linears

    tokenizer, cfg, cpu = tiny_tokenizer(), _quantizable_big_preset(), torch.device("cpu")
    skeleton = build_skeleton(build_preset_config("qwen3-8b", dict(cfg.preset_overrides), len(tokenizer)), torch.float32)
    replace, head, drawn_linears = quantize_as_drawn(skeleton), skeleton.get_output_embeddings(), []

    def spy(module):
        full = [m for m in skeleton.modules() if type(m) is nn.Linear and m is not head and not m.weight.is_meta]
        drawn_linears.append(len(full))
        return replace(module)

    torch.manual_seed(0)
    materialize(skeleton, cpu, spy)
    assert max(drawn_linears) == 1  # the layer just drawn, never two: the full model never exists whole
    assert sum(isinstance(m, NF4Linear) for m in skeleton.modules()) == 14

    quantized = build_base_model(cfg, tokenizer, cpu, torch.bfloat16, seed=3, as_drawn=quantize_as_drawn)
    full = build_base_model(cfg, tokenizer, cpu, torch.bfloat16, seed=3)  # what generate / merge rebuild
    assert nf4_roundtrip_(full, torch.bfloat16) == 14
    layers = {n: m for n, m in quantized.named_modules() if isinstance(m, NF4Linear)}
    assert len(layers) == 14 and isinstance(quantized.get_output_embeddings(), nn.Linear)
    for name, layer in layers.items():
        assert torch.equal(layer.dequantize(), full.get_submodule(name).weight), name
    for name, p in quantized.named_parameters():  # embedding, norms, head: the same draws
        assert torch.equal(p, full.get_parameter(name)), name
    record = quantize_linears(quantized, cpu)  # the plan's transform finds it done and records it
    assert record["quantized_layers"] == 14 and record["kept_layers"] == []
    assert 0 < record["nf4_mib"] < record["weights_mib"] / 2  # ~0.52 of a byte a weight against bf16's 2
    assert sum(isinstance(m, NF4Linear) for m in quantized.modules()) == 14
    assert nf4.can_quantize(quantized.get_output_embeddings())  # the head could be: it is kept by choice


def test_bench_qlora_reference_base_is_drawn_layer_by_layer_without_bitsandbytes():
    from hone.bench.reference import build_quantized_reference_base

    config = build_preset_config("tiny-llama", {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}, 384)
    seen = []

    class Marker(nn.Module):
        def __init__(self, linear: nn.Linear) -> None:
            super().__init__()
            self.register_buffer("weight", linear.weight.detach().clone())

    def quantize(linear: nn.Linear) -> nn.Module:
        assert not linear.weight.is_meta and torch.isfinite(linear.weight).all()
        seen.append(linear.weight.std().item())
        return Marker(linear)

    model = build_quantized_reference_base(config, "float32", torch.device("cpu"), 0, quantize)
    assert len(seen) == 14 and all(abs(s - 0.02) < 0.005 for s in seen)
    assert sum(isinstance(m, Marker) for m in model.modules()) == 14
    assert type(model.get_output_embeddings()) is nn.Linear and not model.get_output_embeddings().weight.is_meta
    ordinary = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert all(torch.equal(b, ordinary.get_buffer(n)) for n, b in model.named_buffers() if "rotary" in n)


def test_load_model_of_a_quantized_big_preset_arrives_quantized_and_the_plan_records_it(tmp_path):
    pytest.importorskip("torchao", reason="NF4 needs the optional 'quant' extra (torchao)")
    from hone.config import parse_config
    from hone.models.loader import load_model
    from hone.models.nf4 import NF4Linear
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    model_cfg = _quantizable_big_preset()
    cfg = parse_config(
        {
            "model": {
                "preset": "qwen3-8b",
                "preset_overrides": model_cfg.preset_overrides,
                "dtype": "bfloat16",
                "quantize": "nf4",
            },
            "data": {"datasets": [{"path": "unused.jsonl", "type": "pretokenized"}], "sequence_len": 32},
            "adapter": {"type": "lora", "lora_r": 4, "lora_target_modules": "all-linear"},
            "training": {"output_dir": str(tmp_path)},
        }
    )
    facts = RunFacts(torch.device("cpu"))
    plan = plan_optimizations(cfg, facts)
    arrived = []

    def base_stage(base):
        arrived.append(sum(isinstance(m, NF4Linear) for m in base.modules()))
        return plan.apply(base, "base", cfg, facts)

    applied = []
    loaded = load_model(
        cfg,
        tiny_tokenizer(),
        "cpu",
        before_adapter=lambda base: applied.extend(base_stage(base)),
        as_drawn=plan.as_drawn(cfg, facts),
    )
    assert arrived == [14]  # quantized as drawn (the plan's quantize transform), before any model hook ran
    record = next(a for a in applied if a.name == "quantize").details
    assert record["quantized_layers"] == 14 and record["kept_layers"] == []
    ids = torch.randint(1, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loaded.model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in loaded.model.parameters() if p.requires_grad)
