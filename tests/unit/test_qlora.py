"""QLoRA (``model.quantize: nf4``): the 4-bit layer, the LoRA around it, the loader, the errors.

Parity is against a reference built from the dequantized weights: the same model with every
quantized layer an ``nn.Linear`` holding ``NF4Linear.dequantize()``, and the same LoRA."""

import copy

import pytest
import torch
from peft import PeftModel
from torch import nn

pytest.importorskip("torchao", reason="NF4 needs the optional 'quant' extra (torchao)")

from hone.config import parse_config  # noqa: E402
from hone.errors import HoneError  # noqa: E402
from hone.models.adapters import apply_adapter  # noqa: E402
from hone.models.nf4 import NF4Linear, NF4LoraLinear, quantize_linears  # noqa: E402
from hone.testing import tiny_tokenizer  # noqa: E402

#: Tiny shapes whose linear layers are multiples of 16,384 weights (NF4's double quantization).
OVERRIDES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "num_hidden_layers": 2,
}


def _cfg(tmp_path, dtype="float32", **extra):
    raw = {
        "model": {"preset": "tiny-llama", "preset_overrides": OVERRIDES, "dtype": dtype, "quantize": "nf4"},
        "data": {"datasets": [{"path": "unused.jsonl", "type": "pretokenized"}], "sequence_len": 32},
        "adapter": {"type": "lora", "lora_r": 4, "lora_target_modules": "all-linear"},
        "training": {"output_dir": str(tmp_path)},
    }
    for section, values in extra.items():
        raw[section] = {**raw.get(section, {}), **values}
    return parse_config(raw)


def _linear(seed, out_features=128, in_features=256, dtype=torch.float32, bias=False):
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.05)
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    return layer.to(dtype)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_nf4_linear_forward_and_input_grad_match_the_dequantized_linear(dtype, tol, bias):
    layer = _linear(1, dtype=dtype, bias=bias)
    q = NF4Linear.from_linear(layer, "cpu")
    assert {n for n, _ in q.named_parameters()} == set() and q.compute_dtype == dtype
    reference = copy.deepcopy(layer)
    with torch.no_grad():
        reference.weight.copy_(q.dequantize())
    assert not torch.equal(reference.weight, layer.weight)  # quantization changed it: a real check
    x = torch.randn(3, 5, 256, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, out_ref = q(x), reference(x_ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    out_ref.backward(grad)
    torch.testing.assert_close(out, out_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=tol, atol=tol)


def _dequantized_copy(model: nn.Module) -> nn.Module:
    """``model`` (quantized, not adapted) with every NF4Linear replaced by an nn.Linear of its
    dequantized weight: the reference QLoRA is compared with."""
    reference = copy.deepcopy(model)
    for parent in list(reference.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, NF4Linear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, dtype=child.compute_dtype)
                with torch.no_grad():
                    linear.weight.copy_(child.dequantize())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                linear.requires_grad_(False)
                setattr(parent, name, linear)
    return reference


def _build(cfg):
    from hone.models.loader import build_base_model

    return build_base_model(cfg.model, tiny_tokenizer(), torch.device("cpu"), torch.float32, seed=0)


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_qlora_model_forward_and_lora_grads_match_the_dequantized_reference(tmp_path, dtype, tol):
    cfg = _cfg(tmp_path, dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    base = _build(cfg)
    from hone.models.loader import cast_parameters

    cast_parameters(base, torch_dtype)
    record = quantize_linears(base, "cpu")
    assert record["quantized_layers"] == 14 and record["kept_layers"] == []  # 7 per layer, head kept
    reference_base = _dequantized_copy(base)
    torch.manual_seed(3)
    model = apply_adapter(base, cfg.adapter)
    torch.manual_seed(3)
    reference = apply_adapter(reference_base, cfg.adapter)
    wrapped = [m for m in model.modules() if isinstance(m, NF4LoraLinear)]
    assert len(wrapped) == 14
    for m in (model, reference):  # hone's precision: LoRA in fp32, compute under autocast
        for p in m.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    with torch.no_grad():  # LoRA B starts at zero: give it values so its path is checked too
        trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
        ref_trained = {n: p for n, p in reference.named_parameters() if p.requires_grad}
        assert trained.keys() == ref_trained.keys()
        for name, p in trained.items():
            assert torch.equal(p, ref_trained[name])  # same LoRA init
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
                ref_trained[name].copy_(p)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    autocast = torch.autocast("cpu", dtype=torch_dtype, enabled=torch_dtype != torch.float32)
    with autocast:
        loss = model(input_ids=ids, labels=ids).loss
    with autocast:
        loss_ref = reference(input_ids=ids, labels=ids).loss
    loss.backward()
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=tol, atol=tol)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys() and len(grads) == 28
    for name in grads:
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
        torch.testing.assert_close(
            grads[name], ref_grads[name], rtol=tol, atol=tol * 10 if dtype == "bfloat16" else tol, msg=name
        )


def test_lora_on_a_4bit_base_cannot_merge_in_place(tmp_path):
    cfg = _cfg(tmp_path)
    base = _build(cfg)
    quantize_linears(base, "cpu")
    model = apply_adapter(base, cfg.adapter)
    assert isinstance(model, PeftModel)
    with pytest.raises(HoneError, match="hone merge"):
        model.merge_and_unload()


def test_layers_that_do_not_fit_the_blocks_stay_full_precision_and_none_at_all_is_an_error(tmp_path):
    from hone.models.loader import build_base_model

    cfg = parse_config(
        {
            "model": {"preset": "tiny-llama", "dtype": "float32", "quantize": "nf4"},
            "data": {"datasets": [{"path": "unused.jsonl", "type": "pretokenized"}], "sequence_len": 32},
            "adapter": {"type": "lora"},
            "training": {"output_dir": str(tmp_path)},
        }
    )
    base = build_base_model(cfg.model, tiny_tokenizer(), torch.device("cpu"), torch.float32, seed=0)
    with pytest.raises(HoneError, match="model.quantize: nf4 found no linear layer"):
        quantize_linears(base, "cpu")


def test_config_refuses_full_finetune_fsdp_and_fp8_of_a_4bit_base(tmp_path):
    with pytest.raises(HoneError, match=r"adapter.type is 'none'.*adapter.type: lora"):
        _cfg(tmp_path, adapter={"type": "none", "lora_target_modules": "all-linear"})
    with pytest.raises(HoneError, match="distributed.strategy: fsdp"):
        _cfg(tmp_path, distributed={"strategy": "fsdp"})
    with pytest.raises(HoneError, match=r"performance.fp8: rowwise.*choose one"):
        _cfg(tmp_path, dtype="bfloat16", performance={"fp8": "rowwise"})


def test_missing_torchao_is_a_clear_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(HoneError, match=r"model.quantize: 'nf4' needs the Python package 'torchao'.*pip install 'hone\[quant\]'"):
        _cfg(tmp_path)


def test_plan_applies_quantize_after_attention_and_loader_never_puts_full_weights_on_the_device(tmp_path):
    from hone.models.loader import load_model
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    cfg = _cfg(tmp_path)
    facts = RunFacts(torch.device("cpu"))
    plan = plan_optimizations(cfg, facts)
    assert plan.names[:2] == ["attention", "quantize"]
    applied = []
    loaded = load_model(
        cfg, tiny_tokenizer(), "cpu", before_adapter=lambda base: applied.extend(plan.apply(base, "base", cfg, facts))
    )
    quant = [a for a in applied if a.name == "quantize"][0]
    assert quant.details["quantized_layers"] == 14 and 0 < quant.details["nf4_mib"] < quant.details["weights_mib"] / 3
    assert all(
        not isinstance(m, nn.Linear) or m is loaded.model.get_output_embeddings() or "lora_" in n
        for n, m in loaded.model.named_modules()
    )
    assert loaded.trainable_params > 0


def test_bench_qlora_reference_is_bitsandbytes_nf4_with_double_quantization():
    bnb = pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model

    from hone.bench.reference import build_qlora_reference_model
    from hone.models.presets import build_preset_config

    config = build_preset_config("tiny-llama", OVERRIDES, 384)
    model = build_qlora_reference_model(config, "bfloat16", torch.device("cpu"), seed=0)
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 14 and model.get_output_embeddings().weight.dtype == torch.float32  # kbit prep upcasts
    state = quantized[0].weight.quant_state
    assert state.quant_type == "nf4" and state.nested and quantized[0].compute_dtype == torch.bfloat16
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)
