"""hone's causal sdpa (no mask prepared by transformers): the same logits and gradients as
transformers' sdpa with its padding mask, on unpadded and right-padded rows, for every
architecture it is chosen for; what it refuses; which runs get it. That transformers then never
reads a device tensor on the host is checked on the GPU (tests/gpu/test_causal_attention_gpu.py)."""

import random

import pytest
import torch

from hone.config import parse_config
from hone.data.collate import collate
from hone.models.attention.causal import CAUSAL_SDPA, causal_sdpa_attention
from hone.models.attention.layout import layout_for
from hone.models.attention.setup import select_attention_kernel
from hone.runtime.loss import forward_logits
from hone.testing import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _cfg(packing: bool = False, **model):
    return parse_config(
        {
            "model": {"preset": "tiny-llama", "dtype": "float32", **model},
            "data": {"datasets": [{"path": "d.jsonl", "type": "completion"}], "sample_packing": packing},
        }
    )


def _batch(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in lengths]
    return collate([{"input_ids": r, "labels": r} for r in rows], pad_id=0)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-mistral", "tiny-qwen3-moe"])
@pytest.mark.parametrize("lengths", [[24, 24], [24, 9, 17]], ids=["unpadded", "right-padded"])
def test_logits_and_gradients_equal_sdpa_with_its_mask(tok, preset, lengths):
    seed = random.randrange(10_000)
    batch = _batch(lengths, seed)
    real = batch.attention_mask.bool()
    results = []
    for select in (False, True):
        model = tiny_model(preset, tok, seed=seed)
        if select:
            assert select_attention_kernel(model, _cfg(), torch.device("cpu"), torch.float32) is not None
            assert model.config._attn_implementation == CAUSAL_SDPA
        logits = forward_logits(model, batch)
        loss = logits[real].logsumexp(-1).mean()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((logits[real].detach(), grads))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(got_grads) == len(want_grads) > 0
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_kv_cache_call_is_refused():
    q = torch.randn(1, 2, 1, 8)
    k = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="no KV cache.*query length 1, key length 5"):
        causal_sdpa_attention(torch.nn.Module(), q, k, k, None)


@pytest.mark.parametrize(
    ("cfg", "preset", "overrides"),
    [
        ({"attn_implementation": "eager"}, "tiny-llama", {}),
        ({}, "tiny-gemma", {"sliding_window": 5}),
        ({}, "tiny-mistral", {"sliding_window": 8}),
    ],
    ids=["eager", "gemma-sliding-window", "mistral-sliding-window"],
)
def test_models_that_need_their_mask_keep_transformers_path(tok, cfg, preset, overrides):
    model = tiny_model(preset, tok, seed=0, **overrides)
    before = model.config._attn_implementation
    assert select_attention_kernel(model, _cfg(**cfg), torch.device("cpu"), torch.float32) is None
    assert model.config._attn_implementation == before != CAUSAL_SDPA


def test_packed_rows_on_the_cpu_carry_hones_document_mask(tok):
    model = tiny_model("tiny-llama", tok, seed=0)
    select_attention_kernel(model, _cfg(packing=True), torch.device("cpu"), torch.float32)
    assert model.config._attn_implementation == CAUSAL_SDPA
    assert layout_for(model).kind == "dense_mask"
