"""hone's varlen sdpa: the reference kernel against a dense document mask, the boundaries it
reads, the paths it hands to transformers' sdpa, and when a run is switched to it. The fused
CUDA kernel itself is checked against the reference in tests/gpu/test_packing_gpu.py."""

import json
import random

import pytest
import torch
import torch.nn.functional as F

from hone.config import ConfigError, parse_config
from hone.data.collate import collate, collate_packed
from hone.errors import HoneError
from hone.models.attention import setup, varlen
from hone.models.attention.layout import layout_for
from hone.models.attention.setup import select_packed_kernel
from hone.models.attention.varlen import (
    VARLEN_SDPA,
    boundaries_from_positions,
    is_boundaries_only,
    reference_varlen_attention,
    register_varlen_sdpa,
)
from hone.runtime.loss import forward_logits
from hone.testing import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_reference_equals_sdpa_with_a_block_diagonal_causal_mask():
    gen = torch.Generator().manual_seed(random.randrange(10_000))
    lengths = [5, 1, 9, 3, 14]
    n, heads, kv_heads, dim = sum(lengths), 4, 2, 8
    q = torch.randn(n, heads, dim, generator=gen)
    k, v = (torch.randn(n, kv_heads, dim, generator=gen) for _ in range(2))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.3, enable_gqa=True
    ).transpose(0, 1)
    out = reference_varlen_attention(q, k, v, _cu(lengths), scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_empty_segments_after_the_last_boundary_change_nothing():
    """The boundaries of packed micro-batches under CUDA graphs end in empty segments (one count
    for every step); the fused kernel is checked the same way in tests/gpu/test_packing_gpu.py."""
    gen = torch.Generator().manual_seed(random.randrange(10_000))
    lengths = [6, 2, 11]
    q = torch.randn(sum(lengths), 4, 8, generator=gen)
    k, v = (torch.randn(sum(lengths), 2, 8, generator=gen) for _ in range(2))
    padded = torch.cat([_cu(lengths), torch.full((3,), sum(lengths), dtype=torch.int32)])
    torch.testing.assert_close(
        reference_varlen_attention(q, k, v, padded, scale=None), reference_varlen_attention(q, k, v, _cu(lengths), scale=None)
    )


def test_a_packed_model_forward_with_fixed_boundaries_equals_the_plain_one(tok):
    """A whole model through the varlen backend (the reference on the CPU): the same logits
    with the boundaries padded by empty segments; the empty ones really reach the kernel."""
    seed = random.randrange(10_000)
    model = _varlen_model(tok, seed)
    docs = [{"input_ids": d.tolist(), "labels": d.tolist()} for d in _docs(seed)]
    bins = [docs[:2], docs[2:]]
    plain, fixed = collate_packed(bins, 24, tok.pad_token_id), collate_packed(bins, 24, tok.pad_token_id, segments=7)
    assert len(plain.cu_seqlens) == 6 and len(fixed.cu_seqlens) == 8  # 2 documents + tail, 1 + tail; 2 empty
    seen = []
    real_reference = varlen.reference_varlen_attention

    def spy(query, key, value, cu_seqlens, *args, **kwargs):
        seen.append(len(cu_seqlens))
        return real_reference(query, key, value, cu_seqlens, *args, **kwargs)

    varlen.reference_varlen_attention = spy
    try:
        with torch.no_grad():
            outs = [forward_logits(model, b) for b in (plain, fixed)]
    finally:
        varlen.reference_varlen_attention = real_reference
    assert set(seen) == {6, 8}
    torch.testing.assert_close(outs[1], outs[0])


def test_boundaries_start_at_every_row_and_wherever_positions_jump():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 0, 1, 2, 3, 4]])
    assert boundaries_from_positions(positions).tolist() == [0, 3, 5, 8, 16, 19, 24]


def _docs(seed, lengths=(7, 12, 5)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(7, 300, (n,), generator=gen) for n in lengths]


def _varlen_model(tok, seed, preset="tiny-llama", **overrides):
    model = tiny_model(preset, tok, seed=seed, **overrides)
    model.set_attn_implementation(register_varlen_sdpa())
    return model.eval()


def test_a_direct_call_with_packed_positions_keeps_documents_apart(tok):
    """Without hone's boundaries (a caller of the model itself), the positions say where
    documents start, as transformers reads them for flash attention."""
    seed = random.randrange(10_000)
    model = _varlen_model(tok, seed)
    docs = _docs(seed)
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        at = 0
        for d in docs:
            alone = model(input_ids=d[None], attention_mask=torch.ones(1, len(d), dtype=torch.long), use_cache=False).logits[0]
            torch.testing.assert_close(packed[at : at + len(d)], alone, rtol=1e-5, atol=1e-5)
            at += len(d)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_packed_batches_skip_transformers_mask_preparation_and_its_host_sync(tok, monkeypatch, preset):
    """A packed batch goes in with the boundaries-only mask: transformers takes it as prepared,
    so it never reads the positions for packed sequences (an ``if`` on a device tensor, a host
    sync per forward on a GPU), and the logits are those of the same batch with no mask at all."""
    import transformers.masking_utils as masking

    seed = random.randrange(10_000)
    model = _varlen_model(tok, seed, preset)
    docs = _docs(seed)
    width = sum(len(d) for d in docs) + 3  # a padding tail too
    batch = collate_packed([[{"input_ids": d.tolist(), "labels": d.tolist()} for d in docs]], width, pad_id=0)
    layout = layout_for(model)
    assert layout.boundaries_only
    with_mask = batch.with_attention(layout)
    assert is_boundaries_only(with_mask.model_inputs()["attention_mask"])
    without = batch.with_attention(layout_for(model).__class__(layout.kind))
    assert "attention_mask" not in without.model_inputs()
    with torch.no_grad():
        reference = forward_logits(model, without)  # transformers reads the positions here

        def no_reading(position_ids):
            raise AssertionError("transformers read the packed positions (a host sync on a GPU)")

        monkeypatch.setattr(masking, "find_packed_sequence_indices", no_reading)
        ours = forward_logits(model, with_mask)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_the_boundaries_only_mask_without_boundaries_is_refused():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="boundaries-only mask but no boundaries"):
        varlen.varlen_sdpa_attention(torch.nn.Module(), q, q, q, varlen.boundaries_only_mask(q.device))


def test_padded_rows_get_transformers_sdpa_unchanged(tok):
    seed = random.randrange(10_000)
    model = _varlen_model(tok, seed)
    rows = [{"input_ids": d.tolist(), "labels": d.tolist()} for d in _docs(seed)]
    batch = collate(rows, pad_id=0)
    with torch.no_grad():
        ours = forward_logits(model, batch)
        model.set_attn_implementation("sdpa")
        theirs = forward_logits(model, batch)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-5, atol=1e-5)


def test_grouped_heads_and_autocast_go_through_the_reference_on_cpu():
    gen = torch.Generator().manual_seed(random.randrange(10_000))
    module = torch.nn.Module()
    q = torch.randn(2, 4, 6, 8, generator=gen)
    k, v = (torch.randn(2, 2, 6, 8, generator=gen) for _ in range(2))
    cu = _cu([2, 4, 6])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = varlen.varlen_sdpa_attention(module, q, k, v, None, scaling=0.5, cu_seq_lens_q=cu, max_length_q=6)
    assert weights is None and out.shape == (2, 6, 4, 8) and out.dtype == torch.bfloat16
    flat = [t.transpose(1, 2).reshape(12, t.shape[1], 8).bfloat16() for t in (q, k, v)]
    torch.testing.assert_close(out.reshape(12, 4, 8), reference_varlen_attention(*flat, cu, 0.5), rtol=0, atol=0)


def test_a_layer_that_needs_more_than_plain_causal_attention_is_refused():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="sliding_window 2"):
        varlen.varlen_sdpa_attention(torch.nn.Module(), q, q, q, None, sliding_window=2, cu_seq_lens_q=_cu([4]), max_length_q=4)


def test_the_saved_model_config_names_no_hone_backend(tok, tmp_path):
    _varlen_model(tok, 0).save_pretrained(tmp_path)
    assert VARLEN_SDPA not in (tmp_path / "config.json").read_text()


# ---------------------------------------------------------------- which runs get it


def _cfg(**model):
    raw = {
        "model": {"preset": "tiny-llama", "dtype": "bfloat16", **model},
        "data": {"datasets": [{"path": "d.jsonl", "type": "completion"}], "sample_packing": True},
    }
    return parse_config(raw)


@pytest.fixture
def kernel_runs(monkeypatch):
    """Pretend the fused kernel runs here (CUDA, bf16), to check the choice on the CPU."""
    monkeypatch.setattr(setup, "fused_kernel_runs", lambda device, dtype: True)


def test_auto_switches_packed_sdpa_where_the_kernel_runs(tok, kernel_runs):
    model = tiny_model("tiny-llama", tok, seed=0)
    note = select_packed_kernel(model, _cfg(), torch.device("cuda"), torch.bfloat16)
    assert "varlen" in note and model.config._attn_implementation == VARLEN_SDPA


@pytest.mark.parametrize(
    ("cfg", "preset", "overrides"),
    [
        ({"sdpa_varlen": False}, "tiny-llama", {}),
        ({"attn_implementation": "eager"}, "tiny-llama", {}),
        ({}, "tiny-gemma", {"sliding_window": 5}),
        ({}, "tiny-llama", {"attention_dropout": 0.1}),
    ],
    ids=["off", "eager", "sliding-window", "attention-dropout"],
)
def test_auto_keeps_the_mask_where_varlen_does_not_apply(tok, kernel_runs, cfg, preset, overrides):
    model = tiny_model(preset, tok, seed=0, **overrides)
    assert select_packed_kernel(model, _cfg(**cfg), torch.device("cuda"), torch.bfloat16) is None
    assert model.config._attn_implementation != VARLEN_SDPA


def test_auto_keeps_the_mask_on_the_cpu_and_true_says_why(tok):
    model = tiny_model("tiny-llama", tok, seed=0)
    assert select_packed_kernel(model, _cfg(), torch.device("cpu"), torch.bfloat16) is None
    with pytest.raises(HoneError, match=r"sdpa_varlen: true.*needs CUDA and bfloat16/float16.*here: cpu.*sdpa_varlen: auto"):
        select_packed_kernel(model, _cfg(sdpa_varlen=True), torch.device("cpu"), torch.bfloat16)
    gemma = tiny_model("tiny-gemma", tok, seed=0, sliding_window=5)
    with pytest.raises(HoneError, match="sliding-window layers"):
        select_packed_kernel(gemma, _cfg(sdpa_varlen=True), torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize(
    ("model", "data", "message"),
    [
        ({"attn_implementation": "flex_attention"}, {}, "sdpa_varlen: true applies to attn_implementation: sdpa"),
        ({"dtype": "float32"}, {}, "model.dtype is float32"),
        ({}, {"sample_packing": False}, "only changes packed rows.*set data.sample_packing: true"),
    ],
)
def test_config_refuses_true_where_it_cannot_apply(model, data, message):
    raw = {
        "model": {"preset": "tiny-llama", "dtype": "bfloat16", "sdpa_varlen": True, **model},
        "data": {"datasets": [{"path": "d.jsonl", "type": "completion"}], "sample_packing": True, **data},
    }
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)
    assert json.dumps(_cfg().model.sdpa_varlen) == '"auto"'


# ---------------------------------------------------------------- grouped key/value heads


def _grouped_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, **causal):
    """What FlashAttention-2 does with fewer key/value heads than query heads (the reference)."""
    return reference_varlen_attention(q, k, v, cu_q, scale, cu_k)


def _refusing_kernel(q, k, v, *args, **kwargs):
    if k.shape[1] != q.shape[1]:
        raise RuntimeError("expect query, key and value to have the same number of heads")
    return _grouped_kernel(q, k, v, *args, **kwargs)


def _first_head_kernel(q, k, v, *args, **kwargs):
    """A kernel that reads grouped heads wrongly: every query head attends through the first."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t[:, :1].expand(-1, q.shape[1], -1) if groups > 1 else t for t in (k, v))
    return _grouped_kernel(q, k, v, *args, **kwargs)


@pytest.mark.parametrize(("kernel", "agrees"), [(_grouped_kernel, True), (_refusing_kernel, False), (_first_head_kernel, False)])
def test_the_probe_passes_grouped_heads_only_to_a_kernel_that_computes_them_right(monkeypatch, kernel, agrees):
    """torch's wrapper without ``enable_gqa`` may pass grouped heads to FlashAttention-2, refuse
    them, or (in principle) read them wrongly: only the first keeps them unrepeated."""
    monkeypatch.setattr(varlen, "_FUSED_KERNEL", kernel)
    assert varlen.grouped_heads_agree(torch.device("cpu"), torch.float32) is agrees


@pytest.mark.parametrize("native", [True, False])
def test_the_fused_call_gets_grouped_heads_as_they_are_where_the_probe_said_so(monkeypatch, native):
    seen = []

    def spy(q, k, v, *args, **kwargs):
        seen.append(k.shape[1])
        return _grouped_kernel(q, k, v, *args, **kwargs)

    monkeypatch.setattr(varlen, "fused_kernel_runs", lambda device, dtype: True)
    monkeypatch.setattr(varlen, "_FUSED_KERNEL", spy)
    monkeypatch.setattr(varlen, "_TAKES_GQA", False)
    monkeypatch.setattr(varlen, "_GROUPED_NATIVE", {None: True} if native else {})
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(20, heads, 8, generator=gen) for heads in (4, 1, 1))
    cu = _cu([12, 8])
    out = varlen.varlen_attention(q, k, v, cu, 12, None)
    assert seen == [1 if native else 4]
    torch.testing.assert_close(out, reference_varlen_attention(q, k, v, cu, None), rtol=1e-5, atol=1e-5)
