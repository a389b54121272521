"""The CUDA paths of the loop: fused AdamW, CUDA RNG restore, bf16 autocast and pure bf16,
fp16 with loss scaling, peak-memory reporting. Skipped without a GPU."""

import random

import pytest
import torch
from rich.console import Console

from hone.testing import plan_hooks, random_rows, tiny_config, tiny_llama
from hone.train.checkpoint import SCALER_FILE
from hone.train.loop import train_loop

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")


def _model(seed: int, *, dtype: torch.dtype = torch.float32, fp32_head: bool = False, dropout: float = 0.0):
    """fp32_head: a frozen low-precision body with a float32 trainable lm_head (the precision
    layout of LoRA on a bf16/fp16 base, which needs autocast)."""
    model = tiny_llama(seed, dropout=dropout).to(dtype)
    if fp32_head:
        model.requires_grad_(False)
        model.lm_head.float().requires_grad_(True)
    return model.to(CUDA)


def _run(model, cfg, train, eval_rows=None, **kw):
    return train_loop(
        model, train, eval_rows, cfg, device=CUDA, pad_id=0, console=Console(quiet=True), hooks=plan_hooks(model, cfg, CUDA), **kw
    )


def test_exact_resume_on_cuda_with_dropout_and_fused_adamw(tmp_path):
    seed = random.randrange(1000)
    rows = random_rows(24, seed=seed, as_list=True)
    training = {"max_steps": 6, "micro_batch_size": 2, "gradient_accumulation_steps": 2}
    opt = {"lr_scheduler": "cosine", "warmup_steps": 1, "fused": "auto"}
    straight_model = _model(seed, dropout=0.2)
    metrics_a = []
    _run(straight_model, tiny_config(tmp_path / "a", training=training, optimizer=opt), rows, step_callback=metrics_a.append)

    def crash(m):
        if m.step == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(
            _model(seed, dropout=0.2),
            tiny_config(tmp_path / "b", training={**training, "save_steps": 3}, optimizer=opt),
            rows,
            step_callback=crash,
        )
    resumed_model = _model(seed, dropout=0.2)
    metrics_b = []
    _run(
        resumed_model,
        tiny_config(tmp_path / "b", training=training, optimizer=opt),
        rows,
        resume_from=tmp_path / "b" / "checkpoints" / "step-3",
        step_callback=metrics_b.append,
    )
    assert [m.step for m in metrics_b] == [4, 5, 6]
    for a, b in zip(metrics_a[3:], metrics_b, strict=True):
        assert abs(a.loss - b.loss) <= 1e-5
    for (name, a), (_, b) in zip(straight_model.named_parameters(), resumed_model.named_parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    assert all(m.peak_mem_gib is not None and m.peak_mem_gib > 0 for m in metrics_a)


@pytest.mark.parametrize("layout", ["bf16-autocast", "bf16-pure", "fp16-scaled"])
def test_low_precision_training_learns(tmp_path, layout):
    seed = random.randrange(1000)
    rows = random_rows(8, seed=seed, as_list=True)
    dtype = {"bf16-autocast": torch.bfloat16, "bf16-pure": torch.bfloat16, "fp16-scaled": torch.float16}[layout]
    model = _model(seed, dtype=dtype, fp32_head=layout != "bf16-pure")
    cfg = tiny_config(
        tmp_path,
        model={"dtype": "float16" if dtype == torch.float16 else "bfloat16"},
        data={"val_set_size": 0.1},
        training={"max_steps": 12, "micro_batch_size": 2, "save_steps": 6, "eval_steps": 12},
        optimizer={"learning_rate": 1e-2},
    )
    result = _run(model, cfg, rows, rows, autocast_dtype=None if layout == "bf16-pure" else dtype)
    assert result.steps == 12
    (_, first), (_, last) = result.eval_losses[0], result.eval_losses[-1]
    assert last < first - 0.05, result.eval_losses
    if layout == "fp16-scaled":
        assert (result.last_checkpoint / SCALER_FILE).exists()
        assert result.skipped_steps <= 3  # overflow skips while the scale settles, at most


def test_windows_prefetched_through_pinned_memory_train_what_the_cpu_trains(tmp_path):
    """Each window is copied (non-blocking, from pinned memory) while the previous step computes;
    the weights after a few steps are the CPU run's, so every step trained its own rows."""
    seed = random.randrange(1000)
    rows = random_rows(24, seed=seed, as_list=True)
    training = {"max_steps": 5, "micro_batch_size": 2, "gradient_accumulation_steps": 2}
    cuda_model = _model(seed)
    _run(cuda_model, tiny_config(tmp_path / "cuda", training=training), rows)
    cpu_model = tiny_llama(seed)
    cfg = tiny_config(tmp_path / "cpu", training=training)
    hooks = plan_hooks(cpu_model, cfg)
    train_loop(cpu_model, rows, None, cfg, device=torch.device("cpu"), pad_id=0, console=Console(quiet=True), hooks=hooks)
    moved = tiny_llama(seed).state_dict()
    assert any(not torch.equal(moved[n], p) for n, p in cpu_model.state_dict().items())
    for (name, a), (_, b) in zip(cpu_model.named_parameters(), cuda_model.named_parameters(), strict=True):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5, msg=name)


def test_peak_memory_is_max_memory_allocated():
    from hone.train.device import peak_memory_gib

    blocks = [torch.empty(random.randrange(1, 64) << 20, dtype=torch.uint8, device=CUDA) for _ in range(3)]
    del blocks[1]
    assert peak_memory_gib(CUDA) == torch.cuda.max_memory_allocated(CUDA) / 2**30 > 0
