"""Packing through the loop: a packed step gives the gradients of the same documents unpacked
(also split over gradient accumulation), packed eval gives the unpacked eval loss, and
``run_training`` reports packing efficiency and plans its steps over packed rows."""

import io
import json
import random

import pytest
import torch
from rich.console import Console

from hone.config import parse_config
from hone.data.collate import collate
from hone.data.packing import pack, row_lengths
from hone.models.attention.varlen import register_varlen_sdpa
from hone.runtime.loss import forward_logits, token_loss_sum
from hone.testing import plan_hooks, random_rows, tiny_config, tiny_llama
from hone.track.metrics import read_metrics
from hone.train.batches import micro_batches
from hone.train.evaluate import evaluate
from hone.train.loop import train_loop

BACKENDS = ["eager", "sdpa", register_varlen_sdpa()]  # varlen: its per-document reference on the CPU


def _grads(model, batches):
    """Gradients of one accumulation window: sum of token losses / the window's trained tokens."""
    model.zero_grad(set_to_none=True)
    total = sum(b.trained_tokens for b in batches)
    for batch in batches:
        (token_loss_sum(forward_logits(model, batch), batch.targets) / total).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("impl", BACKENDS)
def test_a_packed_window_has_the_gradients_of_the_same_documents_unpacked(impl):
    seed = random.randrange(10_000)
    rows = random_rows(10, seed=seed, as_list=True, min_len=10, max_len=20)  # >= 100 tokens: >= 3 bins of 48
    model = tiny_llama(seed)
    model.set_attn_implementation(impl)
    packed = micro_batches(rows, pack(row_lengths(rows), 48, seed, group_size=100), pad_id=0)
    assert packed.units >= 3  # several bins, split over micro-batches of one and two rows
    bins = list(range(packed.units))
    window = [packed(bins[:1]), packed(bins[1:3])] + ([packed(bins[3:])] if packed.units > 3 else [])
    g_packed = _grads(model, window)
    g_padded = _grads(model, [collate(rows[:4], pad_id=0), collate(rows[4:], pad_id=0)])
    assert sum(b.trained_tokens for b in window) == sum(sum(l != -100 for l in r["labels"][1:]) for r in rows)
    for name, grad in g_padded.items():
        scale = grad.abs().max().item()
        assert scale > 0
        torch.testing.assert_close(g_packed[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_one_packed_loop_step_matches_one_unpacked_step(tmp_path):
    seed = random.randrange(10_000)
    rows = random_rows(12, seed=seed, as_list=True, min_len=4, max_len=16)
    bins = pack(row_lengths(rows), 40, seed=7, group_size=100_000).num_bins
    seen = {}
    for name, data, training in (
        ("packed", {"sample_packing": True, "sequence_len": 40}, {"micro_batch_size": 1, "gradient_accumulation_steps": bins}),
        ("padded", {"sequence_len": 40}, {"micro_batch_size": 12, "gradient_accumulation_steps": 1}),
    ):
        cfg = tiny_config(
            tmp_path / name, data=data, training={"max_steps": 1, **training}, model={"attn_implementation": "sdpa"}
        )
        model = tiny_llama(seed)
        model.set_attn_implementation("sdpa")
        metrics = []
        train_loop(
            model,
            rows,
            None,
            cfg,
            device=torch.device("cpu"),
            pad_id=0,
            console=Console(quiet=True),
            step_callback=metrics.append,
            hooks=plan_hooks(model, cfg),
        )
        seen[name] = metrics[0]
    packed, padded = seen["packed"], seen["padded"]
    assert packed.trained_tokens == padded.trained_tokens and packed.tokens == padded.tokens
    assert packed.loss == pytest.approx(padded.loss, rel=1e-5)
    assert packed.grad_norm == pytest.approx(padded.grad_norm, rel=1e-5)


def test_packed_steps_with_fixed_boundaries_train_as_without(tmp_path, monkeypatch):
    """The loop under CUDA graphs' layout (``RunHooks.fixed_boundaries``, set by the plan where
    graphs are on, which the CPU never decides): every packed micro-batch's boundaries count one
    number of segments, and the varlen backend (its reference on the CPU) trains the same steps."""
    from hone.data import collate as collate_module

    seed = random.randrange(10_000)
    rows = random_rows(30, seed=seed, as_list=True, min_len=3, max_len=24)
    seen, counts = {}, {}
    for fixed in (False, True):
        cfg = tiny_config(
            tmp_path / str(fixed),
            data={"sample_packing": True, "sequence_len": 48},
            training={"max_steps": 4, "micro_batch_size": 2},
            model={"attn_implementation": "sdpa"},
        )
        model = tiny_llama(seed)
        model.set_attn_implementation(register_varlen_sdpa())
        hooks = plan_hooks(model, cfg)
        hooks.fixed_boundaries = fixed
        real = collate_module.collate_packed
        monkeypatch.setattr(
            "hone.train.batches.collate_packed",
            lambda *a, **k: counts.setdefault(fixed, set()).add(len((b := real(*a, **k)).cu_seqlens)) or b,
        )
        metrics = []
        train_loop(model, rows, None, cfg, device=torch.device("cpu"), pad_id=0, console=Console(quiet=True),
                   step_callback=metrics.append, hooks=hooks)  # fmt: skip
        seen[fixed] = metrics
    assert len(counts[True]) == 1 and len(counts[False]) > 1  # one count with, the data's own without
    for a, b in zip(seen[False], seen[True], strict=True):
        assert (a.tokens, a.trained_tokens) == (b.tokens, b.trained_tokens)
        assert b.loss == pytest.approx(a.loss, rel=1e-5) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)


def test_packed_eval_gives_the_unpacked_loss():
    seed = random.randrange(10_000)
    rows = random_rows(9, seed=seed, as_list=True)
    model = tiny_llama(seed)
    model.set_attn_implementation("sdpa")
    kw = dict(batch_size=2, pad_id=0, device=torch.device("cpu"))
    plain, packed = (
        evaluate(model, rows, **kw),
        evaluate(model, rows, packing=pack(row_lengths(rows), 64, 0, shuffle=False), **kw),
    )
    assert packed.tokens == plain.tokens
    assert packed.loss == pytest.approx(plain.loss, rel=1e-5)


def test_run_training_packs_reports_efficiency_and_plans_over_packed_rows(tmp_path):
    from hone.train.run import run_training

    words = ["red", "green", "blue", "lemon", "lime", "fox", "dog", "quick", "lazy", "yellow"]
    rng = random.Random()
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 14)))}) + "\n" for _ in range(40))
    )
    cfg = parse_config(
        {
            "model": {"preset": "tiny-llama", "dtype": "float32"},
            "data": {
                "datasets": [{"path": str(data), "type": "completion"}],
                "val_set_size": 0.2,
                "sequence_len": 64,
                "sample_packing": True,
                "dataset_prepared_path": str(tmp_path / "cache"),
            },
            "adapter": {"type": "lora", "lora_r": 4},
            "training": {"num_epochs": 2, "micro_batch_size": 2, "output_dir": str(tmp_path / "run")},
            "optimizer": {"learning_rate": 5e-3},
            "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        }
    )
    out = io.StringIO()
    result = run_training(cfg, device="cpu", console=Console(file=out, width=300))
    text = out.getvalue()
    assert "sample packing (train): 32 rows ->" in text and "sample packing (eval): 8 rows ->" in text
    bins = int(text.split("sample packing: 32 rows -> ")[1].split(" packed rows")[0])
    assert bins < 32 // 2  # several documents per row
    assert result.total_steps == 2 * (bins // 2)
    rows = read_metrics(result.metrics_path)
    train_rows = [r for r in rows if "loss" in r and "eval_loss" not in r]
    assert all(r["tokens"] <= 2 * 64 for r in train_rows) and sum(r["trained_tokens"] for r in train_rows) > 0
    assert result.last_eval_loss < result.first_eval_loss  # it learns through packed rows
