"""FSDP2 on 2 gloo processes equals one process accumulating both micro-batches (fp32, CPU).

Each rank takes one micro-batch of the window; the loss is divided by the trained tokens of the
whole window (both ranks), so the summed gradients must equal one process's accumulated ones.
The sharded side goes through hone's planner (the fsdp transform, its root unit and the plan's
micro-batch forward); the reference is the plain model. Covers LoRA (frozen base, trainable
adapters in the same units) and a full fine-tune with tied embeddings, with checkpointing and
compile (aot_eager) on the sharded side.
"""

import math

import pytest
import torch
from fsdp_harness import full, save, spawn

WORLD = 2


def _cfg(tmp, adapter: str, extra: dict):
    from hone.testing import tiny_config

    sections = {
        "distributed": {"strategy": "fsdp"},
        "performance": {"loss": extra.get("loss", "standard")},
        # AdamW divides by the root of the second moment: rounding-level differences in a tiny
        # gradient entry (the summation order differs) become lr-sized steps; 1e-3 keeps those
        # at fp32 tolerance (the gradients and the global norms are compared directly anyway)
        "optimizer": {"learning_rate": 1e-3},
    }
    if adapter == "lora":
        sections["adapter"] = {"type": "lora", "lora_r": 4, "lora_target_modules": "all-linear"}
    if extra.get("checkpointing"):
        sections["memory"] = {"activation_checkpointing": extra["checkpointing"]}
    if extra.get("compile"):
        sections["performance"].update({"torch_compile": True, "torch_compile_backend": "aot_eager"})
    return tiny_config(tmp, **sections)


def _model(preset: str, adapter: str):
    from hone.testing import tiny_model, tiny_tokenizer, with_random_lora

    torch.manual_seed(11)  # LoRA A draws from the global generator: the same on every process
    model = tiny_model(preset, tiny_tokenizer(), seed=3)
    if adapter == "lora":
        model = with_random_lora(model, seed=4)
    return model


def _window(step: int):
    """Two micro-batches of unequal trained-token counts (fresh random tokens each step)."""
    from hone.data.collate import collate
    from hone.testing import random_rows

    rows = random_rows(4, seed=100 + step, vocab=300, as_list=True)
    return [collate(rows[0:2], pad_id=0), collate(rows[2:4], pad_id=0)]


def _sharded(rank: int, tmp, preset: str, adapter: str, extra: dict, steps: int, out) -> None:
    from hone.runtime.world import world_from_env
    from hone.train.grad_norm import global_grad_norm
    from hone.train.optim import build_optimizer
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    cfg = _cfg(tmp, adapter, extra)
    facts = RunFacts(torch.device("cpu"), world=world_from_env())
    plan = plan_optimizations(cfg, facts)
    assert "fsdp" in plan.names
    model = _model(preset, adapter)
    model.train()
    plan.apply(model, "adapted", cfg, facts)
    hooks = plan.hooks(model, cfg, facts)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, cfg.optimizer, facts.device)
    grads, losses, norms = None, [], []
    for step in range(steps):
        window = _window(step)
        tokens = sum(b.trained_tokens for b in window)
        loss_sum = hooks.step_module(model).module(window[rank])
        (loss_sum / tokens).backward()
        total = loss_sum.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / tokens)
        if step == 0:
            grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        norms.append(float(global_grad_norm(params, extra.get("max_norm"))))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    weights = {n: full(p) for n, p in model.named_parameters() if p.requires_grad}
    if rank == 0:
        save({"grads": grads, "losses": losses, "norms": norms, "weights": weights}, out)


def _reference(tmp, preset: str, adapter: str, extra: dict, steps: int):
    from hone.runtime.step import micro_batch_loss
    from hone.testing import run_hooks
    from hone.train.grad_norm import global_grad_norm
    from hone.train.optim import build_optimizer

    cfg = _cfg(tmp, adapter, {"loss": extra.get("loss", "standard")})
    model = _model(preset, adapter)
    model.train()

    loss_fn = run_hooks(model, loss=extra.get("loss", "standard")).loss_fn
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
    grads, losses, norms = None, [], []
    for step in range(steps):
        window = _window(step)
        tokens = sum(b.trained_tokens for b in window)
        total = 0.0
        for batch in window:
            loss_sum = micro_batch_loss(model, batch, loss_fn)
            (loss_sum / tokens).backward()
            total += float(loss_sum.detach())
        losses.append(total / tokens)
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        norms.append(float(global_grad_norm(params, extra.get("max_norm"))))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"grads": grads, "losses": losses, "norms": norms, "weights": weights}


def _close(a: dict, b: dict, rel: float) -> None:
    assert set(a) == set(b), set(a) ^ set(b)
    for name in a:
        scale = b[name].abs().max().clamp_min(1e-12)
        err = ((a[name] - b[name]).abs().max() / scale).item()
        assert err <= rel, f"{name}: relative error {err:.2e}"


CASES = [
    pytest.param("tiny-llama", "lora", {}, id="lora"),
    pytest.param("tiny-qwen3", "none", {}, id="full-tied"),
    pytest.param("tiny-qwen3", "lora", {"checkpointing": "full", "loss": "fused_linear_ce"}, id="lora-checkpointing-fused"),
    pytest.param("tiny-llama", "none", {"checkpointing": "full", "compile": True}, id="full-checkpointing-compile"),
]


@pytest.mark.parametrize("preset,adapter,extra", CASES)
def test_gradients_are_summed_across_ranks(tmp_path, preset, adapter, extra):
    out = tmp_path / "sharded.pt"
    spawn(_sharded, WORLD, tmp_path, preset, adapter, extra, 1, out)
    got, want = torch.load(out), _reference(tmp_path, preset, adapter, extra, 1)
    assert len(want["grads"]) > 0
    _close(got["grads"], want["grads"], 1e-5)
    assert math.isclose(got["losses"][0], want["losses"][0], rel_tol=1e-6)


@pytest.mark.parametrize("preset,adapter", [("tiny-llama", "lora"), ("tiny-qwen3", "none")])
def test_training_steps_equal_accumulation(tmp_path, preset, adapter):
    """3 optimizer steps, 2 ranks x 1 micro-batch == 1 process x 2 accumulated micro-batches:
    losses, global gradient norms (clipping active) and final weights."""
    extra = {"max_norm": 0.05}
    out = tmp_path / "sharded.pt"
    spawn(_sharded, WORLD, tmp_path, preset, adapter, extra, 3, out)
    got, want = torch.load(out), _reference(tmp_path, preset, adapter, extra, 3)
    for a, b in zip(got["losses"], want["losses"]):
        assert math.isclose(a, b, rel_tol=1e-5), (got["losses"], want["losses"])
    for a, b in zip(got["norms"], want["norms"]):
        assert math.isclose(a, b, rel_tol=1e-5), (got["norms"], want["norms"])
    assert want["norms"][0] > extra["max_norm"]  # clipping was active: its factor came from the global norm
    _close(got["weights"], want["weights"], 1e-5)
