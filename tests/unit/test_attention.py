"""Attention backends: capabilities in the config, refusals with what would work instead, and
packed-sequence isolation for every backend installed here (forward; LoRA gradients where the
backend trains on the CPU)."""

import dataclasses
import random
import re

import pytest
import torch

from hone.config import ConfigError, parse_config
from hone.config import attention as capabilities
from hone.config.attention import BACKENDS, installed_backends
from hone.config.model import ModelConfig
from hone.models.attention.packed_mask import document_ids, uses_own_document_mask
from hone.models.attention.setup import attention_problems
from hone.models.attention.varlen import VARLEN_SDPA, register_varlen_sdpa
from hone.testing import (
    document_logits_alone,
    packed_document_logits,
    random_documents,
    tiny_model,
    tiny_tokenizer,
    with_random_lora,
)

INSTALLED = installed_backends()
TRAINS_ON_CPU = [b for b in INSTALLED if BACKENDS[b].trains_on_cpu]
# hone's varlen sdpa runs its reference (one sdpa call per document) on the CPU: these tests
# check its plumbing (boundaries, flattening, grouped heads); the GPU tests check the kernel
PACKED_PATHS = [*INSTALLED, VARLEN_SDPA]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _pretend_installed(monkeypatch):
    real = capabilities.importlib.util.find_spec
    monkeypatch.setattr(
        capabilities.importlib.util, "find_spec", lambda name, *a: object() if name.startswith("flash_attn") else real(name, *a)
    )


# ---------------------------------------------------------------- config


def test_capabilities_are_computed_properties_of_the_config():
    flex = ModelConfig(preset="tiny-llama", attn_implementation="flex_attention")
    assert flex.attention_isolates_packed_documents and not flex.attention_trains_on_cpu
    assert flex.attention_works_under_compile and flex.attention_supports_sliding_window
    assert flex.attention.skips_masked_blocks and not flex.attention_needs_cuda
    sdpa = ModelConfig(preset="tiny-llama")
    assert sdpa.attn_implementation == "sdpa" and sdpa.attention_trains_on_cpu
    assert "attention" not in sdpa.model_dump()  # derived, never written back


def test_unknown_backend_lists_the_allowed_ones():
    with pytest.raises(ConfigError) as info:
        parse_config(
            {
                "model": {"preset": "tiny-llama", "attn_implementation": "flash2"},
                "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca"}]},
            }
        )
    text = str(info.value)
    for name in BACKENDS:
        assert name in text


@pytest.mark.skipif("flash_attention_2" in INSTALLED, reason="flash-attn is installed here")
def test_flash_without_its_package_is_refused_with_alternatives():
    with pytest.raises(ValueError, match="'flash_attn', which is not installed.*eager, sdpa, flex_attention"):
        ModelConfig(preset="tiny-llama", dtype="bfloat16", attn_implementation="flash_attention_2")


def test_flash_in_float32_is_refused(monkeypatch):
    _pretend_installed(monkeypatch)
    assert ModelConfig(preset="tiny-llama", dtype="bfloat16", attn_implementation="flash_attention_3").attention.needs_cuda
    with pytest.raises(ValueError, match="bfloat16/float16 only.*model.dtype: bfloat16, or use sdpa"):
        ModelConfig(preset="tiny-llama", dtype="float32", attn_implementation="flash_attention_2")


def test_packing_with_a_backend_that_does_not_isolate_is_refused(monkeypatch):
    monkeypatch.setitem(BACKENDS, "eager", dataclasses.replace(BACKENDS["eager"], isolates_packed_documents=False))
    raw = {
        "model": {"preset": "tiny-llama", "attn_implementation": "eager"},
        "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca"}], "sample_packing": True},
    }
    with pytest.raises(ConfigError, match="keeps packed documents apart.*'eager' does not: use one of: sdpa"):
        parse_config(raw)
    raw["data"]["sample_packing"] = False
    assert not parse_config(raw).data.packs_eval


def test_eval_packing_follows_training_packing_unless_set():
    base = {
        "model": {"preset": "tiny-llama"},
        "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca"}], "sample_packing": True},
    }
    assert parse_config(base).data.packs_eval
    base["data"]["eval_sample_packing"] = False
    assert not parse_config(base).data.packs_eval


def test_device_checks_name_what_works(monkeypatch):
    (problem,) = attention_problems(ModelConfig(preset="tiny-llama", attn_implementation="flex_attention"), torch.device("cpu"))
    assert re.search("no backward pass on the CPU.*train with sdpa", problem)
    assert (
        attention_problems(
            ModelConfig(preset="tiny-llama", attn_implementation="flex_attention"), torch.device("cpu"), training=False
        )
        == []
    )
    _pretend_installed(monkeypatch)
    flash = ModelConfig(preset="tiny-llama", dtype="bfloat16", attn_implementation="flash_attention_2")
    (problem,) = attention_problems(flash, torch.device("cpu"))
    assert "CUDA GPUs only, but the device is cpu: use sdpa" in problem


# ---------------------------------------------------------------- packed == alone


def _model(preset, tok, impl, seed, **overrides):
    model = tiny_model(preset, tok, seed=seed, **overrides)
    if impl == VARLEN_SDPA:
        register_varlen_sdpa()
    model.set_attn_implementation(impl)
    return model.eval()


BINS = [[0, 1, 2], [3, 4]]  # two packed rows: three documents, then two and a padding tail
LENGTHS = [9, 4, 13, 11, 6]
WIDTH = 28


def _packed_logits(model, docs, bins=BINS):
    return packed_document_logits(model, docs, bins, WIDTH)


@pytest.mark.parametrize("impl", PACKED_PATHS)
@pytest.mark.parametrize(
    ("preset", "overrides"),
    [("tiny-llama", {}), ("tiny-qwen3-moe", {}), ("tiny-gemma", {"sliding_window": 5})],
    ids=["llama", "qwen3-moe", "gemma-sliding5"],
)
def test_packed_forward_equals_each_document_alone(tok, impl, preset, overrides):
    if impl == "flex_attention" and preset != "tiny-llama":
        pytest.skip("flex compiles anew per model (~30 s on 2 CPU cores); the GPU tests cover it")
    if impl == VARLEN_SDPA and overrides.get("sliding_window"):
        pytest.skip("sliding-window models keep the document mask (select_packed_kernel)")
    seed = random.randrange(10_000)
    model = _model(preset, tok, impl, seed, **overrides)
    docs = random_documents(LENGTHS, seed)
    with torch.no_grad():
        packed = _packed_logits(model, docs)
        for i, doc in enumerate(docs):
            alone = document_logits_alone(model, doc)
            torch.testing.assert_close(packed[i], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", PACKED_PATHS)
def test_perturbing_one_document_leaves_the_others_unchanged(tok, impl):
    seed = random.randrange(10_000)
    model = _model("tiny-llama", tok, impl, seed)
    docs = random_documents(LENGTHS, seed)
    changed = [dict(d) for d in docs]
    changed[1] = {"input_ids": [(t * 7 + 3) % 290 + 7 for t in docs[1]["input_ids"]], "labels": docs[1]["labels"]}
    with torch.no_grad():
        before, after = _packed_logits(model, docs), _packed_logits(model, changed)
    assert not torch.allclose(before[1], after[1], atol=1e-3)  # the perturbation is real
    for i in (0, 2, 3, 4):
        torch.testing.assert_close(before[i], after[i], rtol=0, atol=0)


@pytest.mark.parametrize("impl", [*TRAINS_ON_CPU, VARLEN_SDPA])
def test_packed_lora_gradients_equal_the_per_document_ones(tok, impl):
    seed = random.randrange(10_000)
    model = with_random_lora(_model("tiny-qwen3", tok, impl, seed), seed)
    docs = random_documents(LENGTHS, seed + 1)
    # sum of per-position losses against random weights, so every position's logits matter
    weights = {
        i: torch.randn(len(d["input_ids"]), 1, generator=torch.Generator().manual_seed(seed + i)) for i, d in enumerate(docs)
    }

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    packed = _packed_logits(model, docs)
    g_packed = grads(sum((packed[i] * weights[i]).sum() for i in packed))
    alone = sum((document_logits_alone(model, d) * weights[i]).sum() for i, d in enumerate(docs))
    g_alone = grads(alone)
    assert g_packed.keys() == g_alone.keys() and any("lora_A" in n for n in g_packed)
    for name in g_packed:
        assert g_packed[name].abs().max() > 0, name
        scale = g_alone[name].abs().max().item()  # fp32: 1e-5 relative to the gradient's size
        # eager attention takes its softmax in float32 whatever the model's dtype, over the packed
        # row's full width (masked entries included) vs the document's own length: rounding of
        # the sum differs. In float64 sdpa agrees to 1e-15 and eager to ~4e-7 (the float32
        # softmax); in float32 some seeds reach 6e-5 on eager, so eager gets 1e-4.
        tol = 1e-4 if impl == "eager" else 1e-5
        torch.testing.assert_close(g_packed[name], g_alone[name], rtol=tol, atol=tol * scale, msg=name)


# ---------------------------------------------------------------- hone's own flex document mask


def test_document_ids_follow_restarting_positions():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert document_ids(positions).tolist() == [[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 1, 1]]


def test_own_document_mask_only_for_sdpa_and_flex_without_sliding_windows(tok):
    assert uses_own_document_mask(_model("tiny-llama", tok, "flex_attention", 0))
    assert uses_own_document_mask(_model("tiny-llama", tok, "sdpa", 0))
    assert not uses_own_document_mask(_model("tiny-llama", tok, "eager", 0))
    assert not uses_own_document_mask(_model("tiny-gemma", tok, "sdpa", 0))  # sliding layers


@pytest.mark.parametrize("impl", ["sdpa", "flex_attention"])
def test_own_document_mask_equals_each_document_alone(tok, impl):
    """Through the loop's forward (hone's mask), including a row that one document fills
    exactly: the case where transformers alone would switch to a mask of another kind."""
    seed = random.randrange(10_000)
    model = _model("tiny-llama", tok, impl, seed)
    docs = random_documents([*LENGTHS, WIDTH], seed)
    with torch.no_grad():
        packed = _packed_logits(model, docs, bins=[*BINS, [len(LENGTHS)]])
        for i, doc in enumerate(docs):
            alone = document_logits_alone(model, doc)
            torch.testing.assert_close(packed[i], alone, rtol=1e-5, atol=1e-5)
