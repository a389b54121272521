"""The step boundary's host work overlaps the device's (hone.train.loop): the next window is
collated and the previous step's row written *before* the step's one sync, and yet the run
writes the same rows, in the same order, with each step's own values, and a checkpoint saves
the position of the window its step trained (never the prefetched one)."""

import json
import os
import random
import signal

import pytest
import torch
from rich.console import Console

from hone.testing import plan_hooks, random_rows, tiny_config, tiny_llama
from hone.track.metrics import clean_row, is_eval_row, read_metrics
from hone.track.tracker import Tracker
from hone.train import train_step as train_step_module
from hone.train.batches import BatchStream, PaddedBatches, plan_steps
from hone.train.checkpointer import Checkpointer
from hone.train.loop import NonFiniteLossError, train_loop

CPU = torch.device("cpu")
# measured, so different in every run
TIMING = ("step_time_s", "tokens_per_s", "peak_mem_gib", "peak_reserved_gib", "alloc_retries")


class Crash(Exception):
    pass


def _run(cfg, model, rows, eval_rows=None, *, callback=None, resume_from=None):
    return train_loop(
        model,
        rows,
        eval_rows,
        cfg,
        device=CPU,
        pad_id=0,
        console=Console(quiet=True),
        step_callback=callback,
        resume_from=resume_from,
        hooks=plan_hooks(model, cfg),
    )


def _rows(cfg) -> list[dict]:
    return read_metrics(cfg.training.output_dir / "metrics.jsonl")


def _train_steps(cfg) -> list[int]:
    return [r["step"] for r in _rows(cfg) if not is_eval_row(r)]


def test_the_next_window_and_the_previous_row_are_done_before_the_steps_sync(tmp_path, monkeypatch):
    events: list[str] = []
    collate, read_step, log_train = PaddedBatches.__call__, train_step_module.read_step, Tracker.log_train

    def collating(self, indices):
        events.append("collate")
        return collate(self, indices)

    def reading(*args, **kwargs):
        events.append("sync")
        return read_step(*args, **kwargs)

    def logging(self, row, *args, **kwargs):
        events.append(f"row {row['step']}")
        return log_train(self, row, *args, **kwargs)

    monkeypatch.setattr(PaddedBatches, "__call__", collating)
    monkeypatch.setattr(train_step_module, "read_step", reading)
    monkeypatch.setattr(Tracker, "log_train", logging)
    cfg = tiny_config(tmp_path, training={"max_steps": 3, "micro_batch_size": 2})
    _run(cfg, tiny_llama(random.randrange(1000)), random_rows(12, seed=1), callback=lambda m: events.append(f"step {m.step}"))
    assert events == [
        "collate",  # step 1's window, when nothing was prefetched yet
        "collate",  # step 2's, while step 1 computes
        "sync",
        "step 1",
        "collate",  # step 3's
        "row 1",  # while step 2 computes
        "sync",
        "step 2",
        "row 2",  # nothing prefetched past the last step
        "sync",
        "step 3",
        "row 3",  # before the last step's checkpoint
    ]


def test_rows_hold_their_own_steps_values_in_the_order_of_an_unlagged_log(tmp_path):
    seed = random.randrange(1000)
    cfg = tiny_config(
        tmp_path,
        data={"val_set_size": 0.1},
        training={"max_steps": 5, "micro_batch_size": 2, "gradient_accumulation_steps": 2, "eval_steps": 2},
        logging={"logging_steps": 2},
        optimizer={"lr_scheduler": "cosine", "warmup_steps": 2},
    )
    seen = []
    _run(cfg, tiny_llama(seed), random_rows(30, seed=seed), random_rows(6, seed=seed + 1), callback=seen.append)
    rows = _rows(cfg)
    kinds = [("eval" if is_eval_row(r) else "train", r["step"]) for r in rows]
    # a step's row before its eval row; every 2nd step, the last, and the baseline eval at 0
    assert kinds == [("eval", 0), ("train", 2), ("eval", 2), ("train", 4), ("eval", 4), ("train", 5), ("eval", 5)]
    logged = []
    for window in ([1, 2], [3, 4], [5]):  # a row speaks for the steps since the previous one
        steps = [m for m in seen if m.step in window]
        row = steps[-1].as_row()
        mean = sum(m.loss for m in steps) / len(steps)
        rate = sum(m.tokens for m in steps) / sum(m.step_time_s for m in steps)
        logged.append(clean_row({**row, "loss": mean, "loss_step": row["loss"], "tokens_per_s": rate}))
    assert [r for r in rows if not is_eval_row(r)] == json.loads(json.dumps(logged))  # step time, memory too


def test_a_checkpoint_finds_its_steps_row_already_in_metrics_jsonl(tmp_path, monkeypatch):
    at_save: dict[int, list[int]] = {}
    save = Checkpointer.save

    def saving(self, state, rows):
        at_save[state.step] = _train_steps(cfg)
        return save(self, state, rows)

    monkeypatch.setattr(Checkpointer, "save", saving)
    cfg = tiny_config(tmp_path, training={"max_steps": 5, "micro_batch_size": 2, "save_steps": 2, "save_total_limit": 5})
    _run(cfg, tiny_llama(random.randrange(1000)), random_rows(20, seed=2))
    assert at_save == {2: [1, 2], 4: [1, 2, 3, 4], 5: [1, 2, 3, 4, 5]}


def _forward_fails_on_call(model, call: int):
    calls = {"n": 0}

    def count(module, args, kwargs):
        if module.training:
            calls["n"] += 1
            if calls["n"] == call:
                raise Crash

    model.get_decoder().register_forward_pre_hook(count, with_kwargs=True)  # the loss calls the decoder
    return model


def _nan_always(model):
    model.get_decoder().norm.register_forward_hook(lambda module, args, out: out * float("nan"))
    return model


@pytest.mark.parametrize("ending", ["signal", "callback raises", "forward raises", "diverges"])
def test_every_row_is_written_when_the_run_stops_or_fails(tmp_path, ending):
    seed = random.randrange(1000)
    cfg = tiny_config(tmp_path, training={"max_steps": 6, "micro_batch_size": 2, "max_consecutive_nonfinite": 3})
    model = tiny_llama(seed)
    previous = signal.getsignal(signal.SIGTERM)

    def at_step_3(metrics):
        if metrics.step == 3 and ending == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
        if metrics.step == 3 and ending == "callback raises":
            raise Crash

    if ending == "forward raises":
        model = _forward_fails_on_call(model, 4)  # step 4's forward, after step 3's row was held
    if ending == "diverges":
        model = _nan_always(model)
    expected = {"signal": None, "diverges": NonFiniteLossError}.get(ending, Crash)
    if expected is None:
        result = _run(cfg, model, random_rows(20, seed=seed), callback=at_step_3)
        assert (result.interrupted, result.steps) == ("SIGTERM", 3)
        assert signal.getsignal(signal.SIGTERM) is previous
    else:
        with pytest.raises(expected):
            _run(cfg, model, random_rows(20, seed=seed), callback=at_step_3)
    assert _train_steps(cfg) == [1, 2, 3]


def test_a_stopped_run_saves_the_trained_windows_position_and_resumes_to_the_same_rows(tmp_path, monkeypatch):
    seed = random.randrange(1000)
    data = random_rows(30, seed=seed)
    collated = {"n": 0}
    collate = PaddedBatches.__call__

    def counting(self, indices):
        collated["n"] += 1
        return collate(self, indices)

    monkeypatch.setattr(PaddedBatches, "__call__", counting)

    def config(name, **training):
        return tiny_config(
            tmp_path / name,
            training={"max_steps": 6, "micro_batch_size": 2, "gradient_accumulation_steps": 2, **training},
            optimizer={"lr_scheduler": "linear", "warmup_steps": 2},
        )

    straight = config("straight")
    _run(straight, tiny_llama(seed), data)
    assert collated["n"] == 6 * 2  # nothing prefetched past the last step

    def term_at_3(metrics):
        if metrics.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    collated["n"] = 0
    stopped = config("stopped")
    assert _run(stopped, tiny_llama(seed), data, callback=term_at_3).steps == 3
    assert collated["n"] == 4 * 2  # step 4's window was prefetched, then dropped
    saved = json.loads((tmp_path / "stopped" / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    stream = BatchStream(plan_steps(len(data), stopped.training), stopped.training.seed)
    for _ in range(3):
        stream.next_window()
    assert saved["position"] == stream.position.as_dict()  # where step 4 starts, not step 5

    resumed = config("stopped", resume="latest")
    _run(resumed, tiny_llama(seed), data, resume_from=tmp_path / "stopped" / "checkpoints" / "step-3")
    a, b = _rows(straight), _rows(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for row_a, row_b in zip(a, b, strict=True):
        same_a = {k: v for k, v in row_a.items() if k not in TIMING}
        same_b = {k: v for k, v in row_b.items() if k not in TIMING}
        assert same_b == pytest.approx(same_a, rel=1e-6), row_a["step"]
