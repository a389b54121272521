"""``data.pad_to_sequence_len``: unpacked micro-batches all ``sequence_len`` wide (one shape, for
CUDA graphs) and training, eval and the step counts exactly those of rows padded to their longest."""

import io
import json
import random

import pytest
import torch
from rich.console import Console

from hone.config import ConfigError, parse_config
from hone.data.collate import collate
from hone.testing import random_rows
from hone.track.metrics import read_metrics
from hone.train.batches import micro_batches
from hone.train.run import run_training, shape_note


def test_every_micro_batch_is_sequence_len_wide_and_carries_the_same_rows():
    rows = random_rows(12, seed=random.randrange(10_000), as_list=True, min_len=3, max_len=30)
    free, fixed = micro_batches(rows, None, pad_id=0), micro_batches(rows, None, pad_id=0, pad_to=32)
    widths = set()
    for start in range(0, 12, 3):
        a, b = free(list(range(start, start + 3))), fixed(list(range(start, start + 3)))
        widths.add(a.input_ids.shape[1])
        assert b.input_ids.shape == (3, 32)
        width = a.input_ids.shape[1]
        for name in ("input_ids", "attention_mask", "targets"):
            assert torch.equal(getattr(b, name)[:, :width], getattr(a, name))
        assert (b.attention_mask[:, width:] == 0).all() and (b.targets[:, width:] == -100).all()
        assert (a.tokens, a.trained_tokens) == (b.tokens, b.trained_tokens)
    assert len(widths) > 1  # the rows really differ in length: the test can fail
    with pytest.raises(ValueError, match="a row of 30 tokens does not fit the fixed width of 16"):
        collate([{"input_ids": [1] * 30, "labels": [1] * 30}], pad_id=0, width=16)


def _config(tmp_path, name, **data):
    return parse_config(
        {
            "model": {"preset": "tiny-llama", "dtype": "float32"},
            "data": {
                "datasets": [{"path": str(tmp_path / "data.jsonl"), "type": "completion"}],
                "val_set_size": 0.2,
                "sequence_len": 64,
                "dataset_prepared_path": str(tmp_path / "cache"),
                **data,
            },
            "adapter": {"type": "lora", "lora_r": 4},
            "training": {"max_steps": 4, "micro_batch_size": 4, "eval_steps": 2, "output_dir": str(tmp_path / name), "seed": 3},
            "optimizer": {"learning_rate": 5e-3},
            "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        }
    )


def test_a_run_padded_to_sequence_len_trains_and_evaluates_as_the_run_padded_to_its_rows(tmp_path, monkeypatch):
    from hone.train import batches

    widths = {}

    def spy(rows, pad_id, width=None):
        batch = collate(rows, pad_id, width)
        widths.setdefault(name, set()).add(batch.input_ids.shape[1])
        return batch

    monkeypatch.setattr(batches, "collate", spy)
    words = ["red", "green", "blue", "lemon", "lime", "fox", "dog", "quick", "lazy", "yellow"]
    rng = random.Random()
    (tmp_path / "data.jsonl").write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 14)))}) + "\n" for _ in range(40))
    )
    runs = {}
    for name, data in (("longest", {}), ("fixed", {"pad_to_sequence_len": True})):
        result = run_training(_config(tmp_path, name, **data), device="cpu", console=Console(file=io.StringIO()))
        runs[name] = read_metrics(result.metrics_path)
    assert widths["fixed"] == {64} and len(widths["longest"]) > 1  # training and eval batches alike
    for a, b in zip(runs["longest"], runs["fixed"], strict=True):
        assert a.keys() == b.keys()
        for key in ("loss", "eval_loss", "grad_norm"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), key
        for key in ("tokens", "trained_tokens", "eval_tokens"):
            assert a.get(key) == b.get(key), key


def test_the_fixed_width_is_one_shape_for_the_plan_and_no_preference_setting(tmp_path):
    cfg = _config(tmp_path, "fixed", pad_to_sequence_len=True)
    assert cfg.data.fixed_width == 64 and shape_note(cfg, None) is None
    assert _config(tmp_path, "free").data.fixed_width is None
    with pytest.raises(ConfigError, match="data.pad_to_sequence_len: true does not apply to training.objective: dpo"):
        parse_config(
            {
                "model": {"preset": "tiny-llama"},
                "data": {"datasets": [{"path": "p.jsonl", "type": "preference"}], "pad_to_sequence_len": True},
                "training": {"objective": "dpo"},
            }
        )
