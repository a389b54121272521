"""AdamW parameter groups and the learning-rate schedules."""

import io
import math
import random

import pytest
import torch
from torch import nn

from hone.config.optimizer import OptimizerConfig
from hone.train.optim import build_optimizer, build_scheduler, use_fused

PEAK = 0.1


def _lrs(cfg: OptimizerConfig, total: int, steps: int | None = None) -> list[float]:
    """The learning rate each optimizer step uses, as the loop sees it."""
    param = nn.Parameter(torch.randn(2, 2))
    opt = torch.optim.AdamW([param], lr=cfg.learning_rate)
    sched = build_scheduler(opt, cfg, total)
    seen = []
    for _ in range(steps or total):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen


def _cfg(**kw) -> OptimizerConfig:
    return OptimizerConfig(learning_rate=PEAK, **kw)


def test_warmup_is_linear_and_reaches_the_peak_at_the_last_warmup_step():
    lrs = _lrs(_cfg(lr_scheduler="constant", warmup_steps=4), total=10)
    assert lrs[:4] == pytest.approx([PEAK * k / 4 for k in (1, 2, 3, 4)])
    assert lrs[4:] == pytest.approx([PEAK] * 6)


def test_linear_decay_values():
    lrs = _lrs(_cfg(lr_scheduler="linear", warmup_steps=2), total=10)
    # after warm-up: progress = (i - 2) / 8
    assert lrs[:3] == pytest.approx([PEAK / 2, PEAK, PEAK])
    assert lrs[6] == pytest.approx(PEAK * 0.5)
    assert lrs[9] == pytest.approx(PEAK * 0.125)


def test_cosine_decay_values_and_floor():
    lrs = _lrs(_cfg(lr_scheduler="cosine", warmup_steps=2), total=10)
    assert lrs[2] == pytest.approx(PEAK)
    assert lrs[4] == pytest.approx(PEAK * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lrs[6] == pytest.approx(PEAK * 0.5)
    floor = _lrs(_cfg(lr_scheduler="cosine", warmup_steps=2, cosine_min_lr_ratio=0.1), total=10, steps=14)
    assert floor[6] == pytest.approx(PEAK * (0.1 + 0.9 * 0.5))
    assert floor[12:] == pytest.approx([PEAK * 0.1] * 2)  # past the end: stays at the floor
    assert min(floor) >= PEAK * 0.1 - 1e-12


def test_warmup_ratio_and_no_warmup():
    assert _lrs(_cfg(lr_scheduler="constant", warmup_ratio=0.25), total=8)[:3] == pytest.approx([PEAK / 2, PEAK, PEAK])
    assert _lrs(_cfg(lr_scheduler="linear"), total=4) == pytest.approx([PEAK, 0.75 * PEAK, 0.5 * PEAK, 0.25 * PEAK])


def test_scheduler_state_round_trips_through_a_weights_only_load():
    cfg = _cfg(lr_scheduler="cosine", warmup_steps=3, cosine_min_lr_ratio=0.2)
    total, cut = 20, random.randint(1, 19)
    straight = _lrs(cfg, total)
    param = nn.Parameter(torch.randn(2))
    opt = torch.optim.AdamW([param], lr=PEAK)
    sched = build_scheduler(opt, cfg, total)
    for _ in range(cut):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    # a fresh optimizer/scheduler built from a *different* schedule, then restored
    param2 = nn.Parameter(param.detach().clone())
    opt2 = torch.optim.AdamW([param2], lr=PEAK)
    sched2 = build_scheduler(opt2, _cfg(lr_scheduler="linear"), 5)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    resumed = []
    for _ in range(total - cut):
        resumed.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert resumed == pytest.approx(straight[cut:], rel=1e-12)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_weight_decay_skips_biases_and_norms_and_frozen_weights_are_left_out():
    model = _Block()
    opt = build_optimizer(model, _cfg(weight_decay=0.1), torch.device("cpu"))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {id(p) for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert decayed == {id(model.linear.weight)}
    assert plain == {id(model.linear.bias), id(model.norm.weight), id(model.norm.bias)}
    assert not any(id(p) in decayed | plain for p in model.frozen.parameters())


def test_fused_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert use_fused(_cfg(fused="auto"), cuda) and not use_fused(_cfg(fused="auto"), cpu)
    assert use_fused(_cfg(fused=True), cpu) and not use_fused(_cfg(fused=False), cuda)
    opt = build_optimizer(_Block(), _cfg(fused=True), cpu)  # fused AdamW has a CPU kernel too
    assert opt.defaults["fused"] is True
