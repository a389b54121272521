"""hone's attention with sinks (gpt_oss) against transformers' eager gpt_oss attention in
float32 on the CPU: the flex path forward (flex has no CPU backward) and the dense rescale path
forward and backward, the latter through a whole tiny gpt_oss with sliding windows, padding and packed
documents; and which backend a model with sinks gets. The flex backward is checked in
tests/gpu/test_sink_attention_gpu.py."""

import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers import AutoModelForCausalLM

from hone.config import parse_config
from hone.errors import HoneError
from hone.models.attention.setup import causal_blockers, select_attention_kernel, varlen_blockers
from hone.models.attention.sinks import (
    SINK_ATTENTION,
    dense_sink_attention,
    flex_sink_attention,
    register_sink_attention,
    sink_backend_for,
)
from hone.models.presets import build_preset_config


def _eager_reference(q, k, v, mask, sinks, scale):
    """gpt_oss' eager formula, written out: the sink is one more softmax column, dropped after."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return probs @ v


def _window_mask(width, window):
    def mod(b, h, q, kv):
        return (q >= kv) & (q - kv < window)

    return mod


@pytest.mark.parametrize("window", [None, 5])
def test_flex_and_dense_paths_equal_the_eager_formula(window):
    gen = torch.Generator().manual_seed(random.randrange(10_000))
    batch, heads, kv_heads, width, dim = 2, 4, 2, 19, 8
    q = torch.randn(batch, heads, width, dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, width, dim, generator=gen) for _ in range(2))
    sinks = torch.randn(heads, generator=gen) * 2
    mod = _window_mask(width, window or width)
    mask = mod(0, 0, torch.arange(width)[:, None], torch.arange(width)[None, :]).expand(batch, 1, width, width)
    expected = _eager_reference(q, k, v, mask, sinks, 0.3)
    with torch.no_grad():
        block_mask = create_block_mask(mod, None, None, width, width, device="cpu")
        flex = flex_sink_attention(q, k, v, block_mask, sinks, 0.3)
    torch.testing.assert_close(flex, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dense_sink_attention(q, k, v, mask, sinks, 0.3), expected, rtol=1e-5, atol=1e-6)


def test_dense_path_gradients_equal_the_eager_formula_including_the_sinks():
    gen = torch.Generator().manual_seed(random.randrange(10_000))
    q = torch.randn(2, 4, 11, 8, generator=gen)
    k, v = (torch.randn(2, 2, 11, 8, generator=gen) for _ in range(2))
    sinks = torch.randn(4, generator=gen)
    mask = torch.ones(11, 11, dtype=torch.bool).tril().expand(2, 1, 11, 11).clone()
    mask[1, :, :, 7:] = False  # padding keys
    mask[1, :, 0, 0] = False  # a query that sees nothing gets zero output (and zero gradients)
    grad_out = torch.randn(2, 4, 11, 8, generator=gen)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = fn(*leaves[:3], mask, leaves[3], 0.4)
        (out * grad_out).sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    def reference(q, k, v, mask, sinks, scale):
        out = _eager_reference(q, k, v, mask, sinks, scale)
        return torch.nan_to_num(out)  # the fully masked row: eager puts all weight on the sink

    for got, want in zip(grads(dense_sink_attention), grads(reference)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert grads(dense_sink_attention)[0][1, :, 0].abs().max() == 0


@pytest.fixture(scope="module")
def tiny_gpt_oss():
    config = build_preset_config("tiny-gpt-oss", {"sliding_window": 6}, vocab_size=300)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.5)  # sinks that matter
    return model


def _batches():
    gen = torch.Generator().manual_seed(random.randrange(10_000))
    ids = torch.randint(0, 300, (2, 21), generator=gen)
    padded = torch.ones(2, 21, dtype=torch.long)
    padded[1, 13:] = 0
    positions = torch.cat([torch.arange(9), torch.arange(12)]).expand(2, -1)
    return [
        dict(input_ids=ids),
        dict(input_ids=ids, attention_mask=padded),
        dict(input_ids=ids, position_ids=positions),  # packed: two documents per row
    ]


def _run(model, implementation, batch, backward):
    model.set_attn_implementation(implementation)
    model.zero_grad()
    with torch.set_grad_enabled(backward):
        logits = model(**batch).logits
    keep = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    if backward:
        (logits[keep].float().pow(2).mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if backward and p.grad is not None}
    return logits.detach()[keep], grads


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_tiny_gpt_oss_through_the_sink_backend_equals_eager(tiny_gpt_oss, backward):
    name = register_sink_attention()
    for batch in _batches():
        want_logits, want_grads = _run(tiny_gpt_oss, "eager", batch, backward)
        got_logits, got_grads = _run(tiny_gpt_oss, name, batch, backward)
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
        assert set(got_grads) == set(want_grads)
        for key in want_grads:
            torch.testing.assert_close(got_grads[key], want_grads[key], rtol=1e-4, atol=1e-6, msg=key)
        if backward:
            assert want_grads["model.layers.0.self_attn.sinks"].abs().sum() > 0
    tiny_gpt_oss.set_attn_implementation("eager")


def test_the_sinks_change_the_output(tiny_gpt_oss):
    """The comparison above would pass for a backend that ignored sinks if they did nothing."""
    batch = _batches()[0]
    with torch.no_grad():
        with_sinks, _ = _run(tiny_gpt_oss, register_sink_attention(), batch, False)
        saved = [layer.self_attn.sinks.clone() for layer in tiny_gpt_oss.model.layers]
        for layer in tiny_gpt_oss.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        without, _ = _run(tiny_gpt_oss, register_sink_attention(), batch, False)
        for layer, s in zip(tiny_gpt_oss.model.layers, saved):
            layer.self_attn.sinks.copy_(s)
    assert (with_sinks - without).abs().max() > 1e-2
    tiny_gpt_oss.set_attn_implementation("eager")


def test_generation_through_the_sink_backend_equals_eager(tiny_gpt_oss):
    """A KV cache: the query is shorter than the keys, windows reach back into the cache."""
    prompt = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(random.randrange(10_000)))
    out = {}
    for implementation in ("eager", register_sink_attention()):
        tiny_gpt_oss.set_attn_implementation(implementation)
        with torch.no_grad():
            out[implementation] = tiny_gpt_oss.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    tiny_gpt_oss.set_attn_implementation("eager")
    assert torch.equal(out["eager"], out[SINK_ATTENTION])


def test_a_model_with_sinks_gets_the_sink_backend_or_a_clear_refusal():
    config = build_preset_config("tiny-gpt-oss", {}, vocab_size=300)
    assert sink_backend_for(config, "sdpa") == SINK_ATTENTION
    assert sink_backend_for(config, "flex_attention") == SINK_ATTENTION
    assert sink_backend_for(config, "eager") == "eager"
    for flash in ("flash_attention_2", "flash_attention_3"):
        with pytest.raises(HoneError, match=f"'{flash}' would compute gpt_oss's attention without its attention sinks"):
            sink_backend_for(config, flash)
    assert sink_backend_for(build_preset_config("tiny-llama", {}, 300), "sdpa") == "sdpa"
    # even with every layer attending fully, the sdpa shortcuts would drop the sinks
    full = build_preset_config("tiny-gpt-oss", {}, 300)
    full.layer_types = ["full_attention"] * full.num_hidden_layers
    assert "attention sinks" in causal_blockers(full)
    assert "the model has attention sinks" in varlen_blockers(full, torch.device("cuda"), torch.bfloat16)


def test_the_attention_transform_keeps_the_sink_backend():
    from hone.models.loader import build_base_model
    from hone.testing import tiny_tokenizer

    cfg = parse_config(
        {
            "model": {"preset": "tiny-gpt-oss", "dtype": "float32"},
            "data": {"datasets": [{"path": "d.jsonl", "type": "completion"}]},
        }
    )
    model = build_base_model(cfg.model, tiny_tokenizer(), torch.device("cpu"), torch.float32, seed=0)
    assert model.config._attn_implementation == SINK_ATTENTION
    kernel = select_attention_kernel(model, cfg, torch.device("cpu"), torch.float32)
    assert model.config._attn_implementation == SINK_ATTENTION
    assert "sinks" in kernel


def test_plan_says_a_model_with_sinks_gets_the_sink_backend(tmp_path):
    from hone.config import parse_config
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import decisions

    cfg = parse_config(
        {
            "model": {"preset": "tiny-gpt-oss"},
            "data": {"datasets": [{"path": "d.jsonl", "type": "completion"}]},
            "training": {"output_dir": str(tmp_path)},
        }
    )
    why = {name: reason for name, _, _, reason in decisions(cfg, RunFacts(torch.device("cpu")))}["attention"]
    assert "attention sinks" in why and "causal rows" not in why
