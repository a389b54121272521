"""Loss normalisation: the window's token count divides every micro-batch's summed loss, so
how a step's rows are split into micro-batches does not change the update."""

import random

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from hone.data.collate import collate, rows_at
from hone.runtime.loss import token_loss_sum
from hone.testing import plan_hooks, random_rows, run_hooks, tiny_config, tiny_llama
from hone.train.loop import train_loop
from hone.train.train_step import forward_backward


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _window_grads(seed: int, rows, split: int) -> tuple[float, dict[str, torch.Tensor]]:
    model = tiny_llama(seed)
    window = [collate(rows[i : i + split], pad_id=0) for i in range(0, len(rows), split)]
    tokens = sum(b.trained_tokens for b in window)
    hooks = run_hooks(model)
    loss = forward_backward(hooks.step_module(model), window, tokens, hooks, scaler=None)
    return loss.item(), _grads(model)


def test_one_micro_batch_of_four_equals_four_of_one():
    seed = random.randrange(1000)
    rows = rows_at(random_rows(4, seed=seed, min_len=3, max_len=30), range(4))
    assert len({len(r["input_ids"]) for r in rows}) > 1  # unequal lengths: the case that matters
    loss_4x1, grads_4x1 = _window_grads(seed, rows, split=4)
    loss_1x4, grads_1x4 = _window_grads(seed, rows, split=1)
    loss_2x2, grads_2x2 = _window_grads(seed, rows, split=2)
    assert abs(loss_4x1 - loss_1x4) < 1e-5 and abs(loss_4x1 - loss_2x2) < 1e-5
    for name in grads_4x1:
        torch.testing.assert_close(grads_1x4[name], grads_4x1[name], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grads_2x2[name], grads_4x1[name], rtol=1e-5, atol=1e-7)

    # The loss is the mean over every trained token of the window (computed here independently).
    model = tiny_llama(seed)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            logp = F.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            for t, label in enumerate(row["labels"][1:]):
                if label != -100:
                    total -= logp[t, label].item()
                    count += 1
    assert abs(loss_4x1 - total / count) < 1e-5

    # Averaging per micro-batch instead (what a model's own loss does) gives other gradients:
    # the check above would catch that mistake.
    model = tiny_llama(seed)
    for row in rows:
        batch = collate([row], pad_id=0)
        logits = model(**batch.model_inputs()).logits
        (token_loss_sum(logits, batch.targets) / batch.trained_tokens / len(rows)).backward()
    naive = _grads(model)
    assert any(not torch.allclose(naive[n], grads_4x1[n], rtol=1e-3, atol=1e-6) for n in naive)


def test_training_runs_with_different_splits_give_the_same_weights(tmp_path):
    seed = random.randrange(1000)
    data = random_rows(24, seed=seed, min_len=3, max_len=30)
    results = {}
    for mbs, accum in ((4, 1), (1, 4), (2, 2)):
        cfg = tiny_config(
            tmp_path / f"{mbs}x{accum}",
            training={"micro_batch_size": mbs, "gradient_accumulation_steps": accum, "max_steps": 3},
            optimizer={"learning_rate": 1e-2, "weight_decay": 0.01},
        )
        model = tiny_llama(seed)
        out = train_loop(
            model,
            data,
            None,
            cfg,
            device=torch.device("cpu"),
            pad_id=0,
            console=Console(quiet=True),
            hooks=plan_hooks(model, cfg),
        )
        assert out.steps == 3
        losses = [r["loss"] for r in _rows(cfg)]
        results[(mbs, accum)] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})
    ref_losses, ref_weights = results[(4, 1)]
    start = tiny_llama(seed).state_dict()
    assert any(not torch.equal(ref_weights[n], start[n]) for n in ref_weights)  # training moved them
    for key in ((1, 4), (2, 2)):
        losses, weights = results[key]
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for name in ref_weights:
            # Adam divides by sqrt(v): fp32 rounding in a near-zero gradient moves a weight by
            # ~1e-6; a wrong normalisation moves many by ~lr (1e-2).
            torch.testing.assert_close(weights[name], ref_weights[name], rtol=1e-5, atol=1e-5)


def _rows(cfg):
    from hone.track.metrics import read_metrics

    return [r for r in read_metrics(cfg.training.output_dir / "metrics.jsonl") if "loss" in r]
