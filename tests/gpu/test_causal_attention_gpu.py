"""hone's causal sdpa on CUDA: a training forward and backward with no host sync at all (the
point of it), and the logits and gradients of transformers' sdpa in bf16. Skipped without a GPU."""

import random

import pytest
import torch

from hone.config import parse_config
from hone.data.collate import collate
from hone.models.attention.causal import CAUSAL_SDPA
from hone.models.attention.setup import select_attention_kernel
from hone.testing import tiny_model, tiny_tokenizer, with_random_lora

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")


def _cfg():
    return parse_config(
        {
            "model": {"preset": "tiny-qwen3", "dtype": "bfloat16"},
            "data": {"datasets": [{"path": "d.jsonl", "type": "completion"}]},
        }
    )


def _model(seed, causal, dtype=torch.bfloat16):
    model = tiny_model("tiny-qwen3", tiny_tokenizer(), seed=seed)
    if causal:
        select_attention_kernel(model, _cfg(), CUDA, torch.bfloat16)
        assert model.config._attn_implementation == CAUSAL_SDPA
    else:
        model.set_attn_implementation("sdpa")
    torch.manual_seed(seed)  # PEFT draws the A matrices from the global generator
    return with_random_lora(model, seed).to(CUDA, dtype)


def _batch(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in lengths]
    return collate([{"input_ids": r, "labels": r} for r in rows], pad_id=0).to(CUDA)


def test_a_training_forward_and_backward_never_wait_for_the_device():
    model = _model(0, causal=True)
    batch = _batch([256, 256], 0)
    model(**batch.model_inputs(), use_cache=False)  # warm-up: lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = model(**batch.model_inputs(), use_cache=False)
        out.logits.float().logsumexp(-1).mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _logits_and_grads(model, batch):
    real = batch.attention_mask.bool()
    logits = model(**batch.model_inputs(), use_cache=False).logits.float()
    logits[real].logsumexp(-1).mean().backward()
    return logits[real].detach(), [p.grad.float() for p in model.parameters() if p.grad is not None]


def _error(got, want):
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("lengths", [[256, 256], [256, 100, 190]], ids=["unpadded", "right-padded"])
def test_bf16_logits_and_lora_gradients_are_as_close_to_float32_as_sdpas(lengths):
    """Against float32 sdpa with its mask: hone's causal sdpa in bf16 errs no more than
    transformers' sdpa in bf16 does (a wrong mask would put it orders of magnitude off)."""
    seed = random.randrange(10_000)
    batch = _batch(lengths, seed)
    want, want_grads = _logits_and_grads(_model(seed, False, torch.float32), batch)
    base, base_grads = _logits_and_grads(_model(seed, False), batch)
    got, got_grads = _logits_and_grads(_model(seed, True), batch)
    assert len(got_grads) == len(want_grads) > 0
    assert _error(got, want) <= 1.5 * _error(base, want) + 1e-3
    for g, b, w in zip(got_grads, base_grads, want_grads):
        assert _error(g, w) <= 1.5 * _error(b, w) + 1e-3
