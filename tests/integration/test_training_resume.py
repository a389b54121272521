"""Exact resume: an interrupted run continued from its checkpoint, with fresh model and
optimizer objects (as in a new process), matches an uninterrupted run step for step."""

import io
import os
import random
import signal

import pytest
import torch
from rich.console import Console

from hone.testing import plan_hooks, random_rows, tiny_config, tiny_llama
from hone.track.metrics import read_metrics
from hone.train.checkpoint import list_checkpoints, resolve_resume
from hone.train.loop import train_loop

CPU = torch.device("cpu")
STEPS = 6


class SimulatedCrash(Exception):
    pass


def _config(output_dir, **training):
    return tiny_config(
        output_dir,
        data={"val_set_size": 0.1},
        training={"max_steps": STEPS, "micro_batch_size": 2, "gradient_accumulation_steps": 2, "eval_steps": 2, **training},
        optimizer={"lr_scheduler": "cosine", "warmup_steps": 2, "learning_rate": 5e-3, "weight_decay": 0.01},
    )


def _run(cfg, seed, data, *, resume_from=None, callback=None, console=None):
    # Dropout is on, so the restored RNG state matters for the match.
    model = tiny_llama(seed, dropout=0.2)
    result = train_loop(
        model,
        data[0],
        data[1],
        cfg,
        device=CPU,
        pad_id=0,
        console=console or Console(quiet=True),
        step_callback=callback,
        resume_from=resume_from,
        hooks=plan_hooks(model, cfg),
    )
    return model, result


def _losses(output_dir) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    rows = read_metrics(output_dir / "metrics.jsonl")
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    return train, evals


@pytest.mark.parametrize("interruption", ["crash", "sigterm"])
def test_resumed_run_matches_an_uninterrupted_one(tmp_path, interruption):
    seed = random.randrange(1000)
    data = (random_rows(30, seed=seed), random_rows(6, seed=seed + 1))
    straight_model, straight = _run(_config(tmp_path / "straight"), seed, data)
    assert straight.steps == STEPS

    run_dir = tmp_path / "interrupted"
    if interruption == "crash":
        # A checkpoint at step 3, then the process dies during step 4 (after it was logged).
        def crash(metrics):
            if metrics.step == 4:
                raise SimulatedCrash

        with pytest.raises(SimulatedCrash):
            _run(_config(run_dir, save_steps=3), seed, data, callback=crash)
        assert len(read_metrics(run_dir / "metrics.jsonl")) > 0
    else:
        previous = signal.getsignal(signal.SIGTERM)
        out = io.StringIO()

        def term(metrics):
            if metrics.step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

        _, stopped = _run(_config(run_dir), seed, data, callback=term, console=Console(file=out, width=300))
        assert stopped.interrupted == "SIGTERM" and stopped.steps == 3
        assert stopped.last_checkpoint == run_dir / "checkpoints" / "step-3"
        assert "training.resume=latest" in out.getvalue()
        assert signal.getsignal(signal.SIGTERM) is previous  # handlers restored after the loop
    assert [s for s, _ in list_checkpoints(run_dir)] == [3]

    cfg = _config(run_dir, save_steps=3, resume="latest")
    resume_from = resolve_resume(cfg.training)
    resumed_model, resumed = _run(cfg, seed, data, resume_from=resume_from)
    assert (resumed.start_step, resumed.steps, resumed.interrupted) == (3, STEPS, None)

    # Same losses, step for step; each step logged exactly once despite the crash.
    (train_a, eval_a), (train_b, eval_b) = _losses(tmp_path / "straight"), _losses(run_dir)
    assert [s for s, _ in train_b] == list(range(1, STEPS + 1))
    assert [s for s, _ in eval_b] == [0, 2, 4, 6]
    for (sa, la), (sb, lb) in zip(train_a + eval_a, train_b + eval_b, strict=True):
        assert sa == sb and abs(la - lb) <= 1e-6, (sa, la, lb)
    # Same weights at the end.
    for (name, a), (_, b) in zip(straight_model.named_parameters(), resumed_model.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
    moved = tiny_llama(seed, dropout=0.2).state_dict()
    assert any(not torch.equal(moved[n], p) for n, p in straight_model.state_dict().items())


def test_resuming_from_an_older_checkpoint_drops_the_abandoned_future(tmp_path):
    seed = random.randrange(1000)
    data = (random_rows(20, seed=seed), None)
    cfg = tiny_config(tmp_path, training={"max_steps": 4, "save_steps": 1, "save_total_limit": 10})
    _run(cfg, seed, data)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2, 3, 4]
    older = tmp_path / "checkpoints" / "step-2"
    _, result = _run(cfg, seed, data, resume_from=older)
    assert result.start_step == 2
    train, _ = _losses(tmp_path)
    assert [s for s, _ in train] == [1, 2, 3, 4]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2, 3, 4]  # 3 and 4 rewritten by the new run


def test_extending_max_steps_on_resume_follows_the_new_schedule(tmp_path):
    seed = random.randrange(1000)
    data = (random_rows(20, seed=seed), None)
    short = tiny_config(tmp_path, training={"max_steps": 3}, optimizer={"lr_scheduler": "linear"})
    _, first = _run(short, seed, data)
    longer = tiny_config(tmp_path, training={"max_steps": 6}, optimizer={"lr_scheduler": "linear"})
    out = io.StringIO()
    lrs = []
    _, second = _run(
        longer,
        seed,
        data,
        resume_from=first.last_checkpoint,
        callback=lambda m: lrs.append(m.lr),
        console=Console(file=out, width=300),
    )
    assert second.steps == 6
    # linear over 6 steps from lr 1e-2: step 4 uses (1 - 3/6) of the peak
    assert lrs[0] == pytest.approx(1e-2 * 0.5)
    assert "schedule changed" in out.getvalue()


def test_trainer_state_keeps_eval_rows_only_and_history_comes_from_the_runs_metrics(tmp_path):
    """trainer_state.json does not grow with every logged step; a run resumed into a new
    output directory continues the source run's metrics.jsonl (up to the checkpoint's step),
    and a checkpoint moved away from its run still brings its eval losses for the report."""
    import json
    import shutil

    seed = random.randrange(1000)
    data = (random_rows(30, seed=seed), random_rows(6, seed=seed + 1))
    source = tmp_path / "source"
    _, first = _run(_config(source, save_steps=2, save_total_limit=10), seed, data)
    state = json.loads((source / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert "metrics" not in state
    assert [(r["step"], r["eval_loss"]) for r in state["eval_rows"]] == first.eval_losses[:3]  # steps 0, 2, 4

    for name, checkpoint, expect_train in (
        ("next-to-its-run", source / "checkpoints" / "step-4", [1, 2, 3, 4, 5, 6]),
        ("moved-alone", tmp_path / "moved" / "step-4", [5, 6]),
    ):
        if name == "moved-alone":
            shutil.copytree(source / "checkpoints" / "step-4", checkpoint)
        out_dir = tmp_path / name
        _, resumed = _run(_config(out_dir), seed, data, resume_from=checkpoint)
        # 0, 2 and 4 from the source run, 6 evaluated anew: the uninterrupted run's values
        assert [s for s, _ in resumed.eval_losses] == [s for s, _ in first.eval_losses] == [0, 2, 4, 6]
        assert [l for _, l in resumed.eval_losses] == pytest.approx([l for _, l in first.eval_losses], rel=1e-6)
        train, evals = _losses(out_dir)
        assert [s for s, _ in train] == expect_train and [s for s, _ in evals] == [0, 2, 4, 6]


def test_a_resume_mid_logging_window_logs_the_same_window_means(tmp_path):
    """logging_steps 3, a crash after the checkpoint of step 4 (the window then holds step 4):
    the resumed run's rows at steps 6 and 9 average the same steps (step 4's loss comes back
    with the checkpoint)."""
    seed = random.randrange(1000)
    data = (random_rows(40, seed=seed), None)

    def config(out, **training):
        return tiny_config(out, training={"max_steps": 9, **training}, logging={"logging_steps": 3, "plot": False})

    _run(config(tmp_path / "straight"), seed, data)

    def crash(metrics):
        if metrics.step == 5:
            raise SimulatedCrash

    with pytest.raises(SimulatedCrash):
        _run(config(tmp_path / "crashed", save_steps=4), seed, data, callback=crash)
    _run(config(tmp_path / "crashed", resume="latest"), seed, data, resume_from=tmp_path / "crashed" / "checkpoints" / "step-4")

    def rows(out):
        return [(r["step"], r["loss"], r["loss_step"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r]

    straight = rows(tmp_path / "straight")
    assert [s for s, _, _ in straight] == [3, 6, 9]
    assert straight[1][1] != straight[1][2]  # a mean of three steps, not the last one
    resumed = rows(tmp_path / "crashed")
    assert [s for s, _, _ in resumed] == [3, 6, 9]
    for (_, *a), (_, *b) in zip(straight, resumed, strict=True):
        assert b == pytest.approx(a, rel=1e-6, abs=1e-7)
