"""``optimizer.name: adamw_8bit`` / ``adamw_4bit``: torchao's low-bit AdamW trains, resumes bit for
bit through hone's checkpoints, and refuses clearly where it cannot run."""

import sys

import pytest
import torch
from pydantic import ValidationError
from rich.console import Console
from transformers import AutoModelForCausalLM

from hone.config.optimizer import OptimizerConfig
from hone.errors import HoneError
from hone.models.presets import build_preset_config
from hone.testing import VOCAB, plan_hooks, random_rows, tiny_config
from hone.track.metrics import read_metrics
from hone.train.loop import train_loop
from hone.train.optim import build_optimizer

pytest.importorskip("torchao")
CPU = torch.device("cpu")
LOW_BIT = ["adamw_8bit", "adamw_4bit"]


def _model() -> torch.nn.Module:
    """A 2-layer Llama wide enough that its projections (64 x 64, 64 x 128) get quantized moments
    (torchao quantizes tensors of at least 4,096 values; smaller ones keep float32 moments)."""
    config = build_preset_config("tiny-llama", dict(hidden_size=64, intermediate_size=128, head_dim=16), VOCAB)
    config.pad_token_id = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model


def _train(cfg, resume_from=None):
    model = _model()
    result = train_loop(
        model,
        random_rows(2, seed=3, as_list=True) * 8,  # the same two rows in every step: the loss must fall
        None,
        cfg,
        device=CPU,
        pad_id=0,
        console=Console(quiet=True),
        resume_from=resume_from,
        hooks=plan_hooks(model, cfg),
    )
    return model, result


# the 4-bit case is `long` (~26 s on 2 cores): its resume is the 8-bit one's code, with another state class
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.long) if n == "adamw_4bit" else n for n in LOW_BIT])
def test_low_bit_adamw_trains_and_resumes_bit_for_bit(tmp_path, name):
    straight = tiny_config(tmp_path / "a", training={"max_steps": 6, "save_steps": 3}, optimizer={"name": name, "fused": "auto"})
    model, _ = _train(straight)
    losses = [r["loss"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0]
    saved = torch.load(tmp_path / "a" / "checkpoints" / "step-3" / "optimizer.pt", weights_only=True)
    kinds = {type(v).__name__ for s in saved["state"].values() for v in s.values()}
    assert kinds >= {"OptimState8bit" if name == "adamw_8bit" else "OptimState4bit", "Tensor"}

    again = straight.model_copy(update={"training": straight.training.model_copy(update={"output_dir": tmp_path / "b"})})
    _train(again.model_copy(update={"training": again.training.model_copy(update={"max_steps": 3})}))
    resumed, result = _train(again, resume_from=tmp_path / "b" / "checkpoints" / "step-3")
    assert (result.start_step, result.steps) == (3, 6)
    final = torch.load(tmp_path / "b" / "checkpoints" / "step-6" / "optimizer.pt", weights_only=True)
    assert {type(v).__name__ for s in final["state"].values() for v in s.values()} == kinds  # still quantized
    for (key, want), got in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(want, got), key


def test_low_bit_adamw_builds_torchaos_optimizer_with_hones_groups():
    from torchao.optim import AdamW8bit

    model = _model()
    opt = build_optimizer(model, OptimizerConfig(name="adamw_8bit", weight_decay=0.1), CPU)
    assert isinstance(opt, AdamW8bit)
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.1]  # norms are not decayed


def test_low_bit_adamw_refuses_fused_a_missing_torchao_and_other_devices(monkeypatch):
    with pytest.raises(ValidationError, match="optimizer.fused: true is torch's fused AdamW kernel"):
        OptimizerConfig(name="adamw_4bit", fused=True)
    with pytest.raises(HoneError, match="optimizer.name: adamw_8bit runs on CUDA or the CPU, not on meta"):
        build_optimizer(_model(), OptimizerConfig(name="adamw_8bit"), torch.device("meta"))
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(ValidationError, match=r"needs the Python package 'torchao' .*pip install 'hone\[quant\]'"):
        OptimizerConfig(name="adamw_8bit")
    with pytest.raises(HoneError, match=r"needs the Python package 'torchao' .*pip install 'hone\[quant\]'"):
        build_optimizer(_model(), OptimizerConfig.model_construct(name="adamw_8bit"), CPU)


def test_the_schedule_and_a_changed_schedule_on_resume_fill_torchaos_tensor_learning_rate():
    from hone.train.optim import build_scheduler, make_schedule
    from hone.train.resume import follow_schedule

    cfg = OptimizerConfig(name="adamw_4bit", learning_rate=0.1, lr_scheduler="linear")
    opt = build_optimizer(_model(), cfg, CPU)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor)  # torchao refuses a float in its place
    scheduler = build_scheduler(opt, cfg, total_steps=10)
    scheduler.step()  # no optimizer step needed to move the schedule
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.09)
    follow_schedule(scheduler, make_schedule(cfg, total_steps=20))  # a longer run on resume
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.095)
