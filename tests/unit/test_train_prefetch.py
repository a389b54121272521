"""The window feed (hone.train.prefetch), the step's host-work slot (train_step) and the
one-step-late step log (hone.train.step_log), on their own."""

import io
import json
import random
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from hone.config.logging import LoggingConfig
from hone.config.training import TrainingConfig
from hone.runtime.world import SINGLE
from hone.testing import random_rows
from hone.track.metrics import read_metrics
from hone.track.progress import ProgressDisplay
from hone.track.tracker import Tracker
from hone.train.batches import BatchStream, DataPosition, PaddedBatches, StepPlan, plan_steps
from hone.train.prefetch import WindowFeed
from hone.train.signals import StopRequest
from hone.train.state import TrainState
from hone.train.step_log import StepLog, StepMetrics
from hone.train.train_step import StepOutcome, StepParts, Window, take_window, train_step

CPU = torch.device("cpu")
HOOKS = SimpleNamespace(layout=None, local_batch=lambda batch, host=None: batch)  # padded, no context parallelism


def _stream(rows: int, seed: int) -> BatchStream:
    training = TrainingConfig(max_steps=12, micro_batch_size=2, gradient_accumulation_steps=2)
    return BatchStream(plan_steps(rows, training), seed)


def _same(a: Window, b: Window) -> bool:
    return (
        (a.trained_tokens, a.tokens, a.divisor, a.position) == (b.trained_tokens, b.tokens, b.divisor, b.position)
        and len(a.batches) == len(b.batches)
        and all(torch.equal(x.input_ids, y.input_ids) and torch.equal(x.targets, y.targets) for x, y in zip(a.batches, b.batches))
    )


def test_prefetched_windows_are_the_streams_windows_in_order_each_with_its_own_end_position():
    seed = random.randrange(1000)
    data = random_rows(30, seed=seed)
    batches = PaddedBatches(data, pad_id=0)
    plain = _stream(30, seed)
    expected = []
    for _ in range(12):  # past an epoch boundary: 30 rows make 7 steps of 4
        expected.append(take_window(plain, batches, CPU, HOOKS, SINGLE))
        assert expected[-1].position == plain.position

    stream = _stream(30, seed)
    feed = WindowFeed(stream, batches, CPU, HOOKS, SINGLE)
    got = [feed.next()]
    for step in range(1, 12):
        feed.prefetch()
        feed.prefetch()  # a second call builds nothing more
        assert stream.position == expected[step].position  # one window ahead of the one training
        got.append(feed.next())
    assert all(_same(g, e) for g, e in zip(got, expected, strict=True))
    assert {e.position.epoch for e in expected} == {0, 1}


def test_an_error_while_prefetching_is_raised_where_the_window_is_taken():
    data = random_rows(30, seed=3)

    class Failing(PaddedBatches):
        calls = 0

        def __call__(self, indices):
            Failing.calls += 1
            if Failing.calls == 3:  # the first micro-batch of the second window
                raise ValueError("bad row")
            return super().__call__(indices)

    feed = WindowFeed(_stream(30, 3), Failing(data, pad_id=0), CPU, HOOKS, SINGLE)
    feed.next()
    feed.prefetch()  # fails here, while the current step would still be computing
    assert feed.holds_one
    with pytest.raises(ValueError, match="bad row"):
        feed.next()


def test_a_window_without_trained_tokens_still_gets_the_boundary_work_once():
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    parts = StepParts(None, None, optimizer, None, None, [weight], None)  # no forward, no update for this window
    window = Window([], trained_tokens=0, tokens=7, divisor=0, position=DataPosition(0, 4))
    calls = []
    result = train_step(parts, window, StopRequest(), lambda: calls.append("meanwhile"))
    assert calls == ["meanwhile"]
    assert result.outcome is StepOutcome.NO_TRAINED_TOKENS and weight.grad is None
    assert torch.equal(weight.detach(), torch.ones(2))


def _metrics(step: int) -> StepMetrics:
    return StepMetrics(step, step / 10, 2.0 / step, 1e-3, 0.5, 10, 10 * step, 12, 100.0 * step, 0.12, None, False)


def test_the_step_log_writes_a_held_row_at_the_next_flush_or_hold_and_never_twice(tmp_path):
    tracker = Tracker(
        LoggingConfig(tensorboard=False, plot=False, progress_bar=False), tmp_path, Console(quiet=True), total_steps=4
    )
    log = StepLog(tracker, logging_steps=2)
    written = lambda: [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]  # noqa: E731
    log.hold(_metrics(1), last=False)
    log.hold(_metrics(2), last=False)  # step 1 is not due: only a tick of the display
    assert written() == []
    log.flush()
    assert written() == [2]
    log.flush()
    log.hold(_metrics(3), last=False)
    log.hold(_metrics(4), last=True)
    assert written() == [2]
    log.flush()
    assert written() == [2, 4]
    row = read_metrics(tmp_path / "metrics.jsonl")[1]
    assert row == {
        **_metrics(4).as_row(),
        "loss": (2.0 / 3 + 2.0 / 4) / 2,  # the window's mean: steps 3 and 4
        "loss_step": 2.0 / 4,
        "tokens_per_s": 24 / (0.12 + 0.12),
    }
    tracker.close()


def test_a_row_logs_its_windows_mean_loss_and_tokens_per_s_and_keeps_its_steps_loss(tmp_path):
    """HF Trainer / Axolotl: the logged loss is the mean over the logging window."""
    tracker = Tracker(
        LoggingConfig(tensorboard=False, plot=False, progress_bar=False), tmp_path, Console(quiet=True), total_steps=7
    )
    log = StepLog(tracker, logging_steps=3)
    steps = [  # (loss, tokens, step time)
        (3.0, 10, 1.0),
        (2.0, 30, 1.0),
        (1.0, 20, 4.0),  # row: mean of 3, 2, 1; 60 tokens over 6 s
        (float("nan"), 5, 1.0),  # skipped: a row of its own; its nan is not averaged
        (4.0, 10, 1.0),
        (6.0, 10, 1.0),  # row (step 6): only steps 5 and 6 since the skipped step's row
        (0.5, 8, 2.0),  # last
    ]
    for step, (loss, tokens, seconds) in enumerate(steps, start=1):
        metrics = _metrics(step)
        metrics.loss, metrics.tokens, metrics.step_time_s, metrics.skipped = loss, tokens, seconds, loss != loss
        log.hold(metrics, last=step == len(steps))
    log.flush()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    got = [(r["step"], r["loss"], r["loss_step"], r["tokens_per_s"]) for r in rows]
    assert got == [(3, 2.0, 1.0, 10.0), (4, None, None, 5.0), (6, 5.0, 6.0, 10.0), (7, 0.5, 0.5, 4.0)]
    assert log.state.window_losses == 0  # the window starts again after each row
    tracker.close()


def test_the_loss_window_is_carried_by_the_runs_state_through_a_checkpoint():
    state = TrainState(step=3, window_loss_sum=0.1 + 0.2, window_losses=2)
    saved = json.loads(json.dumps(state.state_dict(StepPlan(20, 2, 1, 10, 10), 0, [])))
    restored = TrainState.from_state_dict(saved)
    assert (restored.window_loss_sum, restored.window_losses) == (0.1 + 0.2, 2)  # bit for bit
    del saved["log_window"]  # a checkpoint of an earlier hone
    assert TrainState.from_state_dict(saved).window_losses == 0


def test_the_console_shows_memory_cuda_allocated_over_reserved_or_cpu_rss():
    out = io.StringIO()
    display = ProgressDisplay(Console(file=out, width=300), total_steps=10, bar=False)
    row = {"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 10.0}
    display.step({**row, "peak_mem_gib": 12.34, "peak_reserved_gib": 14.02})
    display.step({**row, "peak_mem_gib": 0.456, "peak_reserved_gib": None})
    lines = out.getvalue().splitlines()
    assert "| mem 12.3/14.0 GiB |" in lines[0] and "| rss 0.46 GiB |" in lines[1]


def test_a_row_shown_late_gives_the_eta_as_of_its_steps_end():
    out = io.StringIO()
    display = ProgressDisplay(Console(file=out, width=200), total_steps=10, bar=False)
    row = {"step": 4, "loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 10.0}
    at = 1e9  # a clock reading far after the start: 6 steps to go at that pace take years
    assert display.eta_s(4, at + 4.0) == pytest.approx(display.eta_s(4, at) + 6.0)  # 4 s more over 4 steps, 6 to go
    display.step(row)
    assert "days" not in out.getvalue()  # now: moments after the start
    display.step(row, at)
    assert "days" in out.getvalue()
