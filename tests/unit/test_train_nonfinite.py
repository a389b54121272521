"""Non-finite losses and gradients: the step is skipped and counted; a streak stops the run."""

import io
import random

import pytest
import torch
from rich.console import Console
from torch import nn

from hone.errors import HoneError
from hone.testing import plan_hooks, random_rows, tiny_config, tiny_llama
from hone.track.metrics import read_metrics
from hone.train.loop import NonFiniteLossError, train_loop
from hone.train.train_step import UnsupportedPrecision

CPU = torch.device("cpu")


def poisoned(model: nn.Module, bad_calls: set[int] | None) -> nn.Module:
    """``model``, whose final hidden states become NaN on the chosen training forward calls
    (a forward hook on its final norm: whatever loss the plan picks sees NaN logits)."""
    calls = {"n": 0}

    def poison(module, inputs, output):
        if not module.training:
            return output
        calls["n"] += 1
        return output * float("nan") if bad_calls is None or calls["n"] in bad_calls else output

    model.get_decoder().norm.register_forward_hook(poison)
    return model


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_one_nan_loss_is_skipped_counted_and_training_goes_on(tmp_path):
    cfg = tiny_config(
        tmp_path,
        training={"max_steps": 5, "micro_batch_size": 2},
        optimizer={"lr_scheduler": "linear", "learning_rate": 1e-2},
    )
    model = poisoned(tiny_llama(random.randrange(1000)), bad_calls={2})
    weights, lrs = [], []

    def observe(metrics):
        weights.append(_snapshot(model))
        lrs.append(metrics.lr)

    out = io.StringIO()
    result = train_loop(
        model,
        random_rows(12, seed=4),
        None,
        cfg,
        device=CPU,
        pad_id=0,
        console=Console(file=out),
        step_callback=observe,
        hooks=plan_hooks(model, cfg),
    )
    assert (result.steps, result.skipped_steps) == (5, 1)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["skipped"] for r in rows] == [False, True, False, False, False]
    assert rows[1]["loss"] is None and all(r["loss"] is not None for r in rows if not r["skipped"])
    for name, value in weights[1].items():  # step 2 changed nothing
        assert torch.equal(value, weights[0][name])
    assert any(not torch.equal(weights[2][n], weights[1][n]) for n in weights[1])  # step 3 trained again
    assert lrs[1] == lrs[2]  # the schedule did not advance on the skipped step
    assert lrs[2] > lrs[3]
    assert "step 2: loss is nan; step skipped" in out.getvalue()
    assert not any(p.grad is not None for p in model.parameters())  # zeroed after the skip


def test_a_nan_gradient_is_skipped_too(tmp_path):
    cfg = tiny_config(tmp_path, training={"max_steps": 3})
    model = tiny_llama(random.randrange(1000))
    poison = {"on": False}
    weight = model.lm_head.weight
    weight.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    seen = []

    def observe(metrics):
        seen.append((metrics.skipped, metrics.grad_norm))
        poison["on"] = metrics.step == 1  # poison step 2's backward

    result = train_loop(
        model,
        random_rows(8, seed=5),
        None,
        cfg,
        device=CPU,
        pad_id=0,
        console=Console(quiet=True),
        step_callback=observe,
        hooks=plan_hooks(model, cfg),
    )
    assert result.skipped_steps == 1
    assert seen[1][0] and seen[1][1] != seen[1][1]  # skipped with a NaN norm
    assert not seen[0][0] and not seen[2][0]


def test_nan_on_every_step_stops_after_the_configured_streak(tmp_path):
    cfg = tiny_config(tmp_path, training={"max_steps": 20, "max_consecutive_nonfinite": 3})
    model = poisoned(tiny_llama(0), bad_calls=None)
    steps = []
    with pytest.raises(NonFiniteLossError, match=r"3 optimizer steps in a row.*learning_rate") as info:
        train_loop(
            model,
            random_rows(8, seed=6),
            None,
            cfg,
            device=CPU,
            pad_id=0,
            console=Console(quiet=True),
            step_callback=lambda m: steps.append(m.step),
            hooks=plan_hooks(model, cfg),
        )
    assert isinstance(info.value, HoneError)
    assert steps == [1, 2, 3]  # the third skipped step is reported, then the run stops
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["skipped"] for r in rows)


def test_float16_training_is_refused_on_cpu(tmp_path):
    cfg = tiny_config(tmp_path, model={"dtype": "float16"})
    model = tiny_llama(0)
    hooks = plan_hooks(model, cfg)
    with pytest.raises(UnsupportedPrecision, match="float16.*CUDA"):
        train_loop(model, random_rows(8, seed=7), None, cfg, device=CPU, pad_id=0, console=Console(quiet=True), hooks=hooks)


def test_after_step_actions_run_only_after_steps_that_update(tmp_path):
    cfg = tiny_config(tmp_path, training={"max_steps": 4, "micro_batch_size": 2})
    model = poisoned(tiny_llama(random.randrange(1000)), bad_calls={2, 3})
    hooks = plan_hooks(model, cfg)
    ran, steps = [], []
    hooks.after_step.append(lambda: ran.append(len(steps)))  # registered on the optimizer by the loop
    result = train_loop(
        model,
        random_rows(12, seed=8),
        None,
        cfg,
        device=CPU,
        pad_id=0,
        console=Console(quiet=True),
        step_callback=lambda m: steps.append(m.skipped),
        hooks=hooks,
    )
    assert result.skipped_steps == 2 and steps == [False, True, True, False]
    assert ran == [0, 3]  # during steps 1 and 4 (before their callbacks), never during the skipped ones
