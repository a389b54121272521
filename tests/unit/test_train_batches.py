"""Step counting and the seeded, resumable data order."""

import random

import pytest

from hone.config.training import TrainingConfig
from hone.train.batches import BatchStream, DataPosition, NotEnoughData, epoch_order, plan_steps


def _training(**kw) -> TrainingConfig:
    return TrainingConfig(**kw)


@pytest.mark.parametrize(
    ("rows", "mbs", "accum", "epochs", "per_epoch", "total"),
    [
        (100, 4, 2, None, 12, 12),  # default: one epoch; 100 // 8 = 12, 4 rows dropped
        (100, 4, 2, 2.0, 12, 24),
        (100, 4, 2, 0.5, 12, 6),
        (100, 1, 1, 0.29, 100, 29),  # 0.29 * 100 is 28.999... in floats: still 29
        (10, 3, 1, 0.1, 3, 1),  # never zero steps
        (64, 8, 1, 1.5, 8, 12),
    ],
)
def test_steps_from_epochs(rows, mbs, accum, epochs, per_epoch, total):
    kw = {"micro_batch_size": mbs, "gradient_accumulation_steps": accum}
    if epochs is not None:
        kw["num_epochs"] = epochs
    plan = plan_steps(rows, _training(**kw))
    assert plan.steps_per_epoch == per_epoch
    assert plan.total_steps == total
    assert plan.dropped_per_epoch == rows - per_epoch * mbs * accum
    assert f"{total} optimizer steps" in plan.describe()


def test_max_steps_sets_the_total_and_may_exceed_an_epoch():
    plan = plan_steps(20, _training(micro_batch_size=2, gradient_accumulation_steps=2, max_steps=13))
    assert (plan.steps_per_epoch, plan.total_steps) == (5, 13)
    assert plan.epoch_at(13) == pytest.approx(2.6)


def test_too_little_data_for_one_step_is_a_clear_error():
    with pytest.raises(NotEnoughData, match=r"3 rows.*micro_batch_size 2 x .*gradient_accumulation_steps 2 = 4"):
        plan_steps(3, _training(micro_batch_size=2, gradient_accumulation_steps=2))


def test_each_epoch_is_a_fresh_permutation_and_full_steps_only():
    rows, seed = random.randint(20, 60), random.randrange(10_000)
    training = _training(micro_batch_size=3, gradient_accumulation_steps=2, num_epochs=3)
    plan = plan_steps(rows, training)
    stream = BatchStream(plan, seed)
    seen_per_epoch: dict[int, list[int]] = {}
    for _ in range(plan.total_steps):
        epoch = stream.position.epoch if stream.position.index + 6 <= rows else stream.position.epoch + 1
        window = stream.next_window()
        assert [len(mb) for mb in window] == [3, 3]
        seen_per_epoch.setdefault(epoch, []).extend(i for mb in window for i in mb)
    assert sorted(seen_per_epoch) == [0, 1, 2]
    for epoch, seen in seen_per_epoch.items():
        assert len(seen) == len(set(seen)) == plan.steps_per_epoch * 6  # no row twice in an epoch
        assert seen == epoch_order(rows, seed, epoch)[: len(seen)].tolist()
    assert seen_per_epoch[0] != seen_per_epoch[1]  # reshuffled each epoch
    assert epoch_order(rows, seed, 0).tolist() == epoch_order(rows, seed, 0).tolist()
    assert epoch_order(rows, seed, 0).tolist() != epoch_order(rows, seed + 1, 0).tolist()


def test_a_stream_restarted_from_its_position_continues_identically():
    rows, seed = 37, random.randrange(10_000)
    plan = plan_steps(rows, _training(micro_batch_size=2, gradient_accumulation_steps=3, max_steps=20))
    straight = BatchStream(plan, seed)
    windows = [straight.next_window() for _ in range(20)]
    for cut in (1, 5, 6, 7, 13):
        first = BatchStream(plan, seed)
        for _ in range(cut):
            first.next_window()
        saved = DataPosition(**first.position.as_dict())
        resumed = BatchStream(plan, seed, saved)
        assert [resumed.next_window() for _ in range(20 - cut)] == windows[cut:]
