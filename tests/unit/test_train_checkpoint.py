"""Checkpoints: atomic saves, pruning, choosing what to resume from, RNG and weight restore."""

import io
import random

import numpy as np
import pytest
import torch
from rich.console import Console

import hone.train.checkpoint as ckpt
from hone.testing import plan_hooks, random_rows, tiny_config, tiny_llama
from hone.train.checkpoint import (
    COMPLETE,
    CheckpointError,
    capture_rng,
    latest_checkpoint,
    list_checkpoints,
    resolve_resume,
    restore_rng,
)
from hone.train.loop import train_loop

CPU = torch.device("cpu")


def _train(cfg, data, *, seed=0, resume_from=None, **kw):
    model = tiny_llama(seed)
    return train_loop(
        model,
        data,
        None,
        cfg,
        device=CPU,
        pad_id=0,
        console=Console(quiet=True),
        resume_from=resume_from,
        hooks=plan_hooks(model, cfg),
        **kw,
    )


def test_a_crash_mid_save_leaves_the_previous_checkpoint_as_latest(tmp_path, monkeypatch):
    data = random_rows(16, seed=random.randrange(1000))
    cfg = tiny_config(tmp_path, training={"max_steps": 4, "save_steps": 2})
    real_write_state = ckpt._write_state
    saves = []

    class PowerLoss(BaseException):
        """The process dies mid-save: no handler of hone's runs (unlike a disk-full OSError)."""

    def crash_on_second_save(directory, state):
        saves.append(state["step"])
        if state["step"] == 4:
            raise PowerLoss("simulated crash: power lost mid-save")
        real_write_state(directory, state)

    monkeypatch.setattr(ckpt, "_write_state", crash_on_second_save)
    with pytest.raises(PowerLoss, match="simulated crash"):
        _train(cfg, data)
    monkeypatch.undo()

    root = tmp_path / "checkpoints"
    temp = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert len(temp) == 1 and (temp[0] / "trainable.safetensors").exists()  # half-written, left behind
    assert not (temp[0] / COMPLETE).exists()
    (root / "step-9").mkdir()  # an unmarked directory (e.g. half-copied) is not a checkpoint either
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    latest = resolve_resume(tiny_config(tmp_path, training={"max_steps": 4, "save_steps": 2, "resume": "latest"}).training)
    assert latest == root / "step-2"

    resumed = _train(cfg, data, resume_from=latest)
    assert (resumed.start_step, resumed.steps) == (2, 4)
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())  # cleaned by the next save
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4]


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    cfg = tiny_config(tmp_path, training={"max_steps": 5, "save_steps": 1, "save_total_limit": 2})
    result = _train(cfg, random_rows(12, seed=1))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-4", "step-5"]
    assert result.last_checkpoint == tmp_path / "checkpoints" / "step-5"
    for name in ("trainable.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "trainer_state.json", COMPLETE):
        assert (result.last_checkpoint / name).is_file()


def test_resume_latest_without_checkpoint_warns_and_starts_fresh(tmp_path):
    warnings = []
    cfg = tiny_config(tmp_path, training={"resume": "latest"})
    assert resolve_resume(cfg.training, warnings.append) is None
    assert "no complete checkpoint" in warnings[0] and "from scratch" in warnings[0]


def test_resume_from_an_explicit_path(tmp_path):
    cfg = tiny_config(tmp_path / "run", training={"max_steps": 2, "save_steps": 1, "save_total_limit": 5})
    _train(cfg, random_rows(8, seed=2))
    step1 = tmp_path / "run" / "checkpoints" / "step-1"

    def resume(path):
        return resolve_resume(tiny_config(tmp_path / "other", training={"resume": str(path)}).training)

    assert resume(step1) == step1
    assert resume(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "step-2"  # a run dir: its latest
    with pytest.raises(CheckpointError, match="does not exist"):
        resume(tmp_path / "run" / "checkpoints" / "step-7")
    (step1 / COMPLETE).unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resume(step1)
    assert latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "step-2"


def test_resuming_into_another_model_is_a_clear_error(tmp_path):
    cfg = tiny_config(tmp_path, training={"max_steps": 1})
    result = _train(cfg, random_rows(4, seed=3))
    other = tiny_llama(0, freeze_embeddings=False)  # trains one more tensor than the checkpoint has
    cfg2 = tiny_config(tmp_path / "b", training={"max_steps": 2})
    with pytest.raises(CheckpointError, match="not match"):
        train_loop(
            other,
            random_rows(4, seed=3),
            None,
            cfg2,
            device=CPU,
            pad_id=0,
            console=Console(quiet=True),
            resume_from=result.last_checkpoint,
            hooks=plan_hooks(other, cfg2),
        )


def test_rng_states_round_trip_through_a_weights_only_file():
    random.seed(random.randrange(2**31))
    state = capture_rng()
    buf = io.BytesIO()
    torch.save(state, buf)
    expected = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), np.random.randn())
    buf.seek(0)
    restore_rng(torch.load(buf, weights_only=True))
    assert (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), np.random.randn()) == expected


def test_disk_full_while_saving_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch):
    import errno

    from hone.errors import HoneError

    data = random_rows(16, seed=random.randrange(1000))
    cfg = tiny_config(tmp_path, training={"max_steps": 4, "save_steps": 2})
    real_write_torch = ckpt._write_torch

    def disk_fills_at_step_4(directory, name, obj):
        if directory.name.startswith(".tmp-step-4") and name == ckpt.OPTIMIZER_FILE:
            (directory / name).write_bytes(b"partial")  # half a file, as a full disk leaves it
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_torch(directory, name, obj)

    monkeypatch.setattr(ckpt, "_write_torch", disk_fills_at_step_4)
    with pytest.raises(HoneError) as info:
        _train(cfg, data)
    message = str(info.value)
    assert info.value.exit_code == 2 and "\n" not in message
    assert "step-4" in message and "No space left on device" in message
    assert f"previous checkpoint {tmp_path / 'checkpoints' / 'step-2'} is intact" in message
    assert "training.resume: latest" in message
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]  # no temp directory left
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(tmp_path) == root / "step-2"
    restored = ckpt.read_trainer_state(root / "step-2")
    assert restored["step"] == 2


def test_the_plans_state_dict_hooks_map_weights_on_save_and_back_on_load(tmp_path):
    """A transform's state-dict hooks (e.g. quantized weights) see the trainable weights on their
    way into the checkpoint and on their way back; the round trip restores them exactly."""
    from safetensors.torch import load_file

    from hone.runtime.checkpoints import StateDictHooks
    from hone.train.checkpoint import WEIGHTS_FILE, load_checkpoint, save_checkpoint

    model = tiny_llama(random.randrange(1000))
    hooks = [
        StateDictHooks(save=lambda sd: {k: v * 2 for k, v in sd.items()}, load=lambda sd: {k: v / 2 for k, v in sd.items()}),
        StateDictHooks(
            save=lambda sd: {"x." + k: v for k, v in sd.items()}, load=lambda sd: {k.removeprefix("x."): v for k, v in sd.items()}
        ),
    ]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    want = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    path = save_checkpoint(
        tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler, state={"step": 1}, state_dict_hooks=hooks
    )
    stored = load_file(str(path / WEIGHTS_FILE))
    assert stored and all(k.startswith("x.") for k in stored)  # applied in plan order: scaled, then renamed
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, state_dict_hooks=hooks)
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param, want[name], rtol=0, atol=0)
