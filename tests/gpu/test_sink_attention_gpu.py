"""hone's attention with sinks on CUDA (compiled flex attention + lse rescale) against
transformers' eager gpt_oss attention: a tiny gpt_oss in float32 (1e-4), forward and every
gradient, sinks included, with sliding windows shorter than the rows, a padding mask and
packed documents, at rows longer than flex's 128-token blocks; and gpt-oss-20b's attention
shapes (64 query heads, 8 kv heads, head_dim 64, window 128) in bf16 against an fp32
eager reference. Skipped without a GPU."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from hone.models.attention.sinks import dense_sink_attention, flex_sink_attention, register_sink_attention
from hone.models.presets import build_preset_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def tiny_gpt_oss():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = build_preset_config("tiny-gpt-oss", {"sliding_window": 48}, vocab_size=300)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).cuda()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.5)
    return model


def _batches(width=300):
    gen = torch.Generator().manual_seed(random.randrange(10_000))
    ids = torch.randint(0, 300, (2, width), generator=gen).cuda()
    padded = torch.ones(2, width, dtype=torch.long, device="cuda")
    padded[1, 170:] = 0
    positions = torch.cat([torch.arange(130), torch.arange(width - 130)]).expand(2, -1).cuda()
    return {
        "plain": dict(input_ids=ids),
        "padded": dict(input_ids=ids, attention_mask=padded),
        "packed": dict(input_ids=ids, position_ids=positions),
    }


def _run(model, implementation, batch):
    model.set_attn_implementation(implementation)
    model.zero_grad()
    logits = model(**batch).logits
    keep = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    logits[keep].float().pow(2).mean().backward()
    return logits.detach()[keep], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["plain", "padded", "packed"])
def test_tiny_gpt_oss_forward_and_backward_equal_eager_fp32(tiny_gpt_oss, kind):
    batch = _batches()[kind]
    want_logits, want = _run(tiny_gpt_oss, "eager", batch)
    got_logits, got = _run(tiny_gpt_oss, register_sink_attention(), batch)
    tiny_gpt_oss.set_attn_implementation("eager")
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    assert set(got) == set(want)
    for name in want:
        scale = want[name].abs().max().clamp_min(1e-6)
        assert (got[name] - want[name]).abs().max() / scale < 1e-4, name
    assert want["model.layers.0.self_attn.sinks"].abs().sum() > 0


def test_gpt_oss_20b_attention_shapes_in_bf16():
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(10_000))
    batch, heads, kv_heads, width, dim, window = 1, 64, 8, 2048, 64, 128
    q = torch.randn(batch, heads, width, dim, device="cuda", generator=gen)
    k, v = (torch.randn(batch, kv_heads, width, dim, device="cuda", generator=gen) for _ in range(2))
    sinks = torch.randn(heads, device="cuda", generator=gen)
    grad_out = torch.randn(batch, heads, width, dim, device="cuda", generator=gen)
    from torch.nn.attention.flex_attention import create_block_mask

    def mod(b, h, qi, ki):
        return (qi >= ki) & (qi - ki < window)

    block_mask = create_block_mask(mod, None, None, width, width, device="cuda")
    dense = mod(0, 0, torch.arange(width, device="cuda")[:, None], torch.arange(width, device="cuda")[None, :])

    def grads(fn, dtype, mask):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks)]  # fresh leaves per run
        out = fn(*leaves[:3], mask, leaves[3], dim**-0.5)
        (out.float() * grad_out).sum().backward()
        return [out.float()] + [t.grad.float() for t in leaves]

    want = grads(dense_sink_attention, torch.float32, dense.expand(batch, 1, width, width))
    got = grads(flex_sink_attention, torch.bfloat16, block_mask)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        rel = (g - w).norm() / w.norm()
        assert rel < 2e-2, (name, rel.item())
