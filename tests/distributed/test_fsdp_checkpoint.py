"""Sharded (DCP) checkpoints: resume on the same world size is exact; 2 -> 1 and 1 -> 2 reshard.

A tiny Qwen3 (tied embeddings), full fine-tune, fp32 on gloo: 4 optimizer steps with a
checkpoint after step 2, then fresh processes resume from it and run steps 3-4.
"""

import math

import pytest
import torch
from fsdp_harness import full, save, spawn
from test_fsdp_grads import _cfg, _model, _window

PRESET, ADAPTER, STEPS, SAVE_AT = "tiny-qwen3", "none", 4, 2


def _train(rank: int, tmp, run_dir, resume, out, fmt: str = "auto") -> None:
    from hone.runtime.world import world_from_env
    from hone.testing import run_hooks
    from hone.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from hone.train.grad_norm import global_grad_norm
    from hone.train.optim import build_optimizer, build_scheduler
    from hone.train.sharded_checkpoint import save_sharded_checkpoint
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    world = world_from_env()
    cfg = _cfg(tmp, ADAPTER, {})
    facts = RunFacts(torch.device("cpu"), world=world)
    model = _model(PRESET, ADAPTER)
    model.train()
    if world.distributed:
        plan = plan_optimizations(cfg, facts)
        plan.apply(model, "adapted", cfg, facts)
        hooks = plan.hooks(model, cfg, facts)
    else:
        hooks = run_hooks(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, cfg.optimizer, facts.device)
    scheduler = build_scheduler(optimizer, cfg.optimizer, STEPS)
    start = 0
    if resume is not None:
        start = load_checkpoint(latest_checkpoint(resume), model=model, optimizer=optimizer, scheduler=scheduler)["step"]
    losses = []
    for step in range(start, STEPS):
        window = _window(step)
        tokens = sum(b.trained_tokens for b in window)
        mine = [window[world.rank]] if world.distributed else window
        total = torch.zeros(())
        for batch in mine:
            loss_sum = hooks.step_module(model).module(batch)
            (loss_sum / tokens).backward()
            total += loss_sum.detach()
        if world.distributed:
            torch.distributed.all_reduce(total)
        losses.append(float(total) / tokens)
        global_grad_norm(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step + 1 == SAVE_AT and resume is None:
            # "auto": the loop's save_checkpoint (DCP when the model is sharded, the one-process
            # format otherwise); "dcp": a one-process run writing DCP
            save = save_sharded_checkpoint if fmt == "dcp" else save_checkpoint
            save(run_dir, step + 1, model=model, optimizer=optimizer, scheduler=scheduler, state={"step": step + 1})
    weights = {n: full(p) for n, p in model.named_parameters() if p.requires_grad}
    if world.rank == 0:
        torch.save({"losses": losses, "weights": weights}, out)


def _run(tmp, world: int, run_dir, resume=None, fmt: str = "auto"):
    out = tmp / f"out-{world}-{'resumed' if resume else 'fresh'}-{run_dir.name}.pt"
    spawn(_train, world, tmp, run_dir, resume, out, fmt)
    return torch.load(out)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    return tmp, tmp / "run2", _run(tmp, 2, tmp / "run2")


def test_checkpoint_is_atomic_and_complete(two_rank_run):
    from hone.train.checkpoint import latest_checkpoint
    from hone.train.sharded_checkpoint import is_sharded_checkpoint

    _, run_dir, _ = two_rank_run
    found = latest_checkpoint(run_dir)
    assert found is not None and found.name == f"step-{SAVE_AT}" and is_sharded_checkpoint(found)
    assert sorted(p.name for p in found.glob("rng-rank*.pt")) == ["rng-rank0.pt", "rng-rank1.pt"]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_resume_same_world_size_is_exact(two_rank_run):
    tmp, run_dir, fresh = two_rank_run
    resumed = _run(tmp, 2, run_dir, resume=run_dir)
    assert resumed["losses"] == fresh["losses"][SAVE_AT:]
    for name, value in fresh["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name


def test_resume_two_ranks_on_one(two_rank_run):
    tmp, run_dir, fresh = two_rank_run
    resumed = _run(tmp, 1, run_dir, resume=run_dir)
    for a, b in zip(resumed["losses"], fresh["losses"][SAVE_AT:]):
        assert math.isclose(a, b, rel_tol=1e-5)
    for name, value in fresh["weights"].items():
        err = ((resumed["weights"][name] - value).abs().max() / value.abs().max()).item()
        assert err < 1e-5, name


@pytest.mark.parametrize("fmt", ["dcp", "auto"])
def test_resume_one_rank_on_two(tmp_path, fmt):
    """A one-process run's checkpoint, as DCP or in the one-process format, resumes on 2 ranks."""
    from hone.train.checkpoint import latest_checkpoint
    from hone.train.sharded_checkpoint import is_sharded_checkpoint

    one = _run(tmp_path, 1, tmp_path / "run1", fmt=fmt)
    assert is_sharded_checkpoint(latest_checkpoint(tmp_path / "run1")) == (fmt == "dcp")
    resumed = _run(tmp_path, 2, tmp_path / "run1", resume=tmp_path / "run1")
    for a, b in zip(resumed["losses"], one["losses"][SAVE_AT:]):
        assert math.isclose(a, b, rel_tol=1e-5)
    for name, value in one["weights"].items():
        err = ((resumed["weights"][name] - value).abs().max() / value.abs().max()).item()
        assert err < 1e-5, name


def _save_final(rank: int, tmp, preset: str, adapter: str, out_dir, out) -> None:
    from hone.config.adapter import AdapterConfig
    from hone.models.save import save_final
    from hone.runtime.world import world_from_env
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    cfg = _cfg(tmp, adapter, {})
    facts = RunFacts(torch.device("cpu"), world=world_from_env())
    model = _model(preset, adapter)
    plan = plan_optimizations(cfg, facts)
    plan.apply(model, "adapted", cfg, facts)
    adapter_cfg = cfg.adapter if adapter != "lora" else AdapterConfig(type="lora", lora_r=4, lora_target_modules="all-linear")
    save_final(model, None, out_dir, adapter_cfg)  # every rank calls it; it gathers, rank 0 writes
    weights = {n: full(p) for n, p in model.named_parameters()}
    if rank == 0:
        save(weights, out)


@pytest.mark.parametrize("preset,adapter", [("tiny-llama", "lora"), ("tiny-qwen3", "none")])
def test_final_output_gathered_by_rank0(tmp_path, preset, adapter):
    """The sharded model's final output loads where users load it (PeftModel.from_pretrained /
    from_pretrained) and holds exactly the sharded weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hone.testing import tiny_model, tiny_tokenizer

    out_dir, out = tmp_path / "final", tmp_path / "weights.pt"
    spawn(_save_final, 2, tmp_path, preset, adapter, out_dir, out)
    sharded = torch.load(out)
    if adapter == "lora":
        assert (out_dir / "adapter_model.safetensors").is_file() and (out_dir / "adapter_config.json").is_file()
        loaded = PeftModel.from_pretrained(tiny_model(preset, tiny_tokenizer(), seed=3), str(out_dir))
    else:
        loaded = AutoModelForCausalLM.from_pretrained(str(out_dir))
    names = dict(loaded.named_parameters())
    checked = 0
    for name, value in sharded.items():
        key = name if name in names else name.replace(".default.", ".")
        if "lora_" in name or adapter != "lora":
            assert torch.equal(names[key].detach(), value), name
            checked += 1
    assert checked > 0
