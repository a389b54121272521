"""Packing on CUDA: flex_attention trains (it has no CPU backward), and every backend keeps
packed documents apart on the GPU as on the CPU. Skipped without a GPU."""

import io
import json
import random

import pytest
import torch
from rich.console import Console

from hone.config.adapter import AdapterConfig
from hone.models.adapters import apply_adapter
from hone.models.attention.capabilities import installed_backends
from hone.models.testing import tiny_model, tiny_tokenizer
from hone.train.collate import collate_packed

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
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(7, 300, (n,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    return out


def _model(preset, tok, impl, seed, lora=False, **overrides):
    model = tiny_model(preset, tok, seed=seed, **overrides)
    model.set_attn_implementation(impl)
    if lora:
        model = apply_adapter(model, AdapterConfig(type="lora", lora_r=4, lora_target_modules="all-linear"))
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data = torch.randn(p.shape, generator=gen) * 0.1
    return model.to(CUDA)


def _packed(model, docs):
    batch = collate_packed([[docs[i] for i in b] for b in BINS], WIDTH, pad_id=0).to(CUDA)
    out = model(**batch.model_inputs(), use_cache=False).logits
    pieces = {}
    for row, b in enumerate(BINS):
        at = 0
        for i in b:
            n = len(docs[i]["input_ids"])
            pieces[i] = out[row, at : at + n]
            at += n
    return pieces


def _alone(model, doc):
    return model(input_ids=torch.tensor([doc["input_ids"]], device=CUDA), use_cache=False).logits[0]


@pytest.mark.parametrize("impl", [b for b in installed_backends() if b != "eager"])
@pytest.mark.parametrize("preset,overrides", [("tiny-llama", {}), ("tiny-qwen3-moe", {}), ("tiny-gemma", {"sliding_window": 48})])
def test_packed_forward_equals_alone_on_cuda(tok, impl, preset, overrides):
    if impl.startswith("flash"):
        pytest.skip("flash kernels compute in bf16/fp16; this test is fp32")
    seed = random.randrange(10_000)
    model = _model(preset, tok, impl, seed, **overrides).eval()
    docs = _docs(seed)
    with torch.no_grad():
        packed = _packed(model, docs)
        for i, doc in enumerate(docs):
            torch.testing.assert_close(packed[i], _alone(model, doc), rtol=1e-4, atol=1e-4)


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
    g_alone = grads(sum((_alone(model, d) * weights[i]).sum() for i, d in enumerate(docs)))
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
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))}) + "\n" for _ in range(200)))
    cfg = parse_config(
        {
            "model": {"preset": "tiny-llama", "dtype": "bfloat16", "attn_implementation": impl},
            "data": {"datasets": [{"path": str(data), "type": "completion"}], "val_set_size": 0.1, "sequence_len": 128,
                     "sample_packing": True, "dataset_prepared_path": str(tmp_path / "cache")},
            "adapter": {"type": "lora", "lora_r": 8},
            "training": {"num_epochs": 3, "micro_batch_size": 2, "gradient_accumulation_steps": 2, "output_dir": str(tmp_path / "run")},
            "optimizer": {"learning_rate": 1e-2},
            "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        }
    )
    out = io.StringIO()
    result = run_training(cfg, device="cuda", console=Console(file=out, width=300))
    assert result.skipped_steps == 0 and "sample packing: 180 rows" in out.getvalue()
    assert result.last_eval_loss < result.first_eval_loss
