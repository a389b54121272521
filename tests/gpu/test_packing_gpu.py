"""Packing on CUDA: flex_attention trains (it has no CPU backward), and every backend keeps
packed documents apart on the GPU as on the CPU. Skipped without a GPU."""

import io
import json
import random

import pytest
import torch
from rich.console import Console

from hone.config.attention import installed_backends
from hone.models.attention.varlen import VARLEN_SDPA, reference_varlen_attention, register_varlen_sdpa, varlen_attention
from hone.testing import (
    document_logits_alone,
    packed_document_logits,
    random_documents,
    tiny_model,
    tiny_tokenizer,
    with_random_lora,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
BINS = [[0, 1, 2], [3, 4]]
# every document >= 128 tokens: a shorter query would send flex_attention's reference forward
# to its decoding kernel, which inductor cannot lower in float32 ("No choices to select")
LENGTHS = [130, 160, 140, 200, 129]
WIDTH = 448


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _docs(seed):
    return random_documents(LENGTHS, seed)


def _model(preset, tok, impl, seed, lora=False, **overrides):
    model = tiny_model(preset, tok, seed=seed, **overrides)
    model.set_attn_implementation(impl)
    if lora:
        model = with_random_lora(model, seed)
    return model.to(CUDA)


def _packed(model, docs, autocast=None):
    return packed_document_logits(model, docs, BINS, WIDTH, autocast)


@pytest.mark.parametrize("impl", [*(b for b in installed_backends() if b != "eager"), VARLEN_SDPA])
@pytest.mark.parametrize("preset,overrides", [("tiny-llama", {}), ("tiny-qwen3-moe", {}), ("tiny-gemma", {"sliding_window": 48})])
def test_packed_forward_equals_alone_on_cuda(tok, impl, preset, overrides):
    if impl.startswith("flash"):
        pytest.skip("flash kernels compute in bf16/fp16; this test is fp32")
    seed = random.randrange(10_000)
    if impl == VARLEN_SDPA:
        if "sliding_window" in overrides:
            pytest.skip("sliding-window models keep the document mask (select_packed_kernel)")
        register_varlen_sdpa()  # float32 here: its reference path on CUDA; the kernel is tested below
    model = _model(preset, tok, impl, seed, **overrides).eval()
    docs = _docs(seed)
    with torch.no_grad():
        packed = _packed(model, docs)
        for i, doc in enumerate(docs):
            torch.testing.assert_close(packed[i], document_logits_alone(model, doc), rtol=1e-4, atol=1e-4)


def test_flex_trains_packed_lora_with_the_per_document_gradients(tok):
    seed = random.randrange(10_000)
    model = _model("tiny-qwen3", tok, "flex_attention", seed, lora=True)
    docs = _docs(seed + 1)
    weights = {i: torch.randn(len(d["input_ids"]), 1, device=CUDA) for i, d in enumerate(docs)}

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    packed = _packed(model, docs)
    g_packed = grads(sum((packed[i] * weights[i]).sum() for i in packed))
    g_alone = grads(sum((document_logits_alone(model, d) * weights[i]).sum() for i, d in enumerate(docs)))
    for name, grad in g_alone.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(g_packed[name], grad, rtol=1e-4, atol=1e-4 * scale, msg=name)


def test_flex_perturbing_one_document_leaves_the_others(tok):
    seed = random.randrange(10_000)
    model = _model("tiny-llama", tok, "flex_attention", seed).eval()
    docs = _docs(seed)
    changed = list(docs)
    changed[2] = {"input_ids": [(t * 7 + 3) % 290 + 7 for t in docs[2]["input_ids"]], "labels": docs[2]["labels"]}
    with torch.no_grad():
        a, b = _packed(model, docs), _packed(model, changed)
    assert not torch.allclose(a[2], b[2], atol=1e-3)
    for i in (0, 1, 3, 4):
        torch.testing.assert_close(a[i], b[i], rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["sdpa", "flex_attention"])
def test_bf16_lora_run_with_packing_learns(tmp_path, impl):
    from hone.config import parse_config
    from hone.train.run import run_training

    words = ["red", "green", "blue", "lemon", "lime", "fox", "dog", "quick", "lazy", "yellow"]
    rng = random.Random()
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))}) + "\n" for _ in range(200))
    )
    cfg = parse_config(
        {
            "model": {"preset": "tiny-llama", "dtype": "bfloat16", "attn_implementation": impl},
            "data": {
                "datasets": [{"path": str(data), "type": "completion"}],
                "val_set_size": 0.1,
                "sequence_len": 128,
                "sample_packing": True,
                "dataset_prepared_path": str(tmp_path / "cache"),
            },
            "adapter": {"type": "lora", "lora_r": 8},
            "training": {
                "num_epochs": 3,
                "micro_batch_size": 2,
                "gradient_accumulation_steps": 2,
                "output_dir": str(tmp_path / "run"),
            },
            "optimizer": {"learning_rate": 1e-2},
            "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        }
    )
    out = io.StringIO()
    result = run_training(cfg, device="cuda", console=Console(file=out, width=300))
    assert result.skipped_steps == 0 and "sample packing: 180 rows" in out.getvalue()
    assert ("varlen kernel" in out.getvalue()) == (impl == "sdpa"), out.getvalue()
    assert result.last_eval_loss < result.first_eval_loss


# ---------------------------------------------------------------- torch's varlen kernel (bf16)


@pytest.mark.parametrize("heads", ["as_they_are", "repeated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_varlen_kernel_matches_the_reference_forward_and_backward(dtype, heads, monkeypatch):
    """torch's kernel (grouped heads, head dim 128, documents of 1 to 700 tokens) against the
    per-document sdpa reference in float32, values and gradients at half-precision tolerance;
    the grouped key/value heads handed over as they are (where torch takes them: ``enable_gqa``
    or the probe of :func:`~hone.models.attention.varlen.grouped_heads_native`) or repeated."""
    from hone.models.attention import varlen

    if heads == "repeated":
        monkeypatch.setattr(varlen, "_TAKES_GQA", False)
        monkeypatch.setattr(varlen, "_GROUPED_NATIVE", {})
    elif not varlen.grouped_heads_native(CUDA):
        pytest.skip(f"torch {torch.__version__}'s varlen wrapper refuses grouped heads (the probe said so)")
    gen = torch.Generator(device=CUDA).manual_seed(random.randrange(10_000))
    lengths = [700, 1, 33, 300, 129, 64, 5]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    n, heads, kv_heads, dim = sum(lengths), 8, 2, 128
    inputs = [torch.randn(n, h, dim, generator=gen, device=CUDA, dtype=dtype) for h in (heads, kv_heads, kv_heads)]
    fused_in = [t.clone().requires_grad_() for t in inputs]
    ref_in = [t.float().requires_grad_() for t in inputs]
    fused = varlen_attention(*fused_in, cu, 1024, scale=dim**-0.5)
    ref = reference_varlen_attention(*ref_in, cu, scale=dim**-0.5)
    assert fused.dtype == dtype
    torch.testing.assert_close(fused.float(), ref, rtol=2e-2, atol=2e-2)
    upstream = torch.randn(n, heads, dim, generator=gen, device=CUDA)
    (fused.float() * upstream).sum().backward()
    (ref * upstream).sum().backward()
    for name, a, b in zip("qkv", fused_in, ref_in):
        scale = b.grad.abs().max().item()
        torch.testing.assert_close(a.grad.float(), b.grad, rtol=2e-2, atol=2e-2 * scale, msg=name)


def test_fused_varlen_kernel_ignores_empty_segments_after_the_last_boundary():
    """Packed micro-batches under CUDA graphs end their boundaries in empty segments (one count
    for every step): the fused kernel's values and gradients are those without them."""
    gen = torch.Generator(device=CUDA).manual_seed(random.randrange(10_000))
    lengths = [300, 1, 129, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    padded = torch.cat([cu, cu[-1:].repeat(5)])
    n = sum(lengths)
    inputs = [torch.randn(n, h, 128, generator=gen, device=CUDA, dtype=torch.bfloat16) for h in (8, 2, 2)]
    upstream = torch.randn(n, 8, 128, generator=gen, device=CUDA)
    results = []
    for bounds in (cu, padded):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = varlen_attention(*leaves, bounds, 512, scale=128**-0.5)
        (out.float() * upstream).sum().backward()
        results.append([out.float(), *(t.grad.float() for t in leaves)])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a)


def test_varlen_packed_lora_equals_the_masked_sdpa_in_bf16(tok):
    """A bf16 LoRA model through the kernel and through hone's document mask: the same logits
    and LoRA gradients, at bf16 tolerance."""
    seed = random.randrange(10_000)
    model = _model("tiny-qwen3", tok, "sdpa", seed, lora=True).to(torch.bfloat16)
    for _name, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()  # adapters train in float32 under bf16 autocast, as in a run
    docs = _docs(seed + 1)
    weights = {i: torch.randn(len(d["input_ids"]), 1, device=CUDA) for i, d in enumerate(docs)}

    def run(impl):
        model.base_model.model.set_attn_implementation(impl)
        model.zero_grad(set_to_none=True)
        packed = _packed(model, docs, torch.bfloat16)
        sum((packed[i].float() * weights[i]).sum() for i in packed).backward()
        return packed, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    masked, g_masked = run("sdpa")
    fused, g_fused = run(register_varlen_sdpa())
    for i in masked:
        # two bf16 attention kernels round differently, and the rounding compounds over the
        # layers: a random seed's model had 17 of 61,440 logits ~10 bf16 ulps apart (0.04 at a
        # largest logit of ~0.7, session 32), so each token's logits are compared as a whole
        # (document isolation is held to float32 tolerance by test_packed_forward_equals_alone_on_cuda)
        got, want = fused[i].float(), masked[i].float()
        per_token = (got - want).norm(dim=-1) / want.norm(dim=-1)
        assert per_token.max().item() < 5e-2, f"document {i}: {per_token.max().item():.2e} relative error in a token's logits"
    for name, grad in g_masked.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(g_fused[name], grad, rtol=5e-2, atol=2e-2 * scale, msg=name)
