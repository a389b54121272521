"""torchao's low-bit AdamW on CUDA (``optimizer.name: adamw_8bit`` / ``adamw_4bit``): the optimizer
state it allocates is what ``hone plan`` counts, it trains like AdamW, and its state survives a
save/load bit for bit. Skipped without a GPU."""

import io

import pytest
import torch
from torch import nn

pytest.importorskip("torchao", reason="low-bit AdamW needs the optional 'quant' extra (torchao)")

from hone.config.optimizer import OptimizerConfig  # noqa: E402
from hone.train.optim import build_optimizer  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
LR = 1e-3


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(4)]).to(CUDA, dtype)


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(64, 2048, device=CUDA, generator=gen, dtype=next(model.parameters()).dtype)
    loss = model(x).float().square().mean()  # drive the output to zero: falls steadily under AdamW
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _bytes(t: torch.Tensor) -> int:
    """Bytes a moment holds: a plain tensor's, or the sum of a torchao subclass's inner tensors
    (codes, block scales, the code map)."""
    if type(t) is torch.Tensor:
        return t.numel() * t.element_size()
    inner, _ = t.__tensor_flatten__()
    return sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in inner)


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "adamw_4bit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_state_allocated_is_what_the_plan_counts(name, dtype):
    model = _model(dtype)
    cfg = OptimizerConfig(name=name, learning_rate=1e-4)
    opt = build_optimizer(model, cfg, CUDA)
    _step(model, opt, 0)  # the state exists after the first step
    torch.cuda.synchronize()
    state = sum(_bytes(t) for s in opt.state.values() for k, t in s.items() if k != "step")
    params = sum(p.numel() for p in model.parameters())
    expected = cfg.state_bytes(params, torch.finfo(dtype).bits // 8)
    assert abs(state - expected) / expected < 0.02, (state, expected)


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_4bit"])
def test_trains_like_adamw_and_resumes_bit_for_bit(name):
    reference, model = _model(torch.float32), _model(torch.float32)
    ref_opt = build_optimizer(reference, OptimizerConfig(learning_rate=LR), CUDA)
    opt = build_optimizer(model, OptimizerConfig(name=name, learning_rate=LR), CUDA)
    ref_losses = [_step(reference, ref_opt, s) for s in range(20)]
    losses = [_step(model, opt, s) for s in range(20)]
    assert losses[-1] < 0.5 * losses[0]
    assert abs(losses[-1] - ref_losses[-1]) / ref_losses[-1] < 0.1, (losses, ref_losses)  # close to 32-bit AdamW
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    after = [_step(model, opt, s) for s in range(20, 25)]
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    again = _model(torch.float32)
    again.load_state_dict(saved["model"])
    again_opt = build_optimizer(again, OptimizerConfig(name=name, learning_rate=LR), CUDA)
    again_opt.load_state_dict(saved["opt"])
    assert [_step(again, again_opt, s) for s in range(20, 25)] == after
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)
