"""``logging.trackers``: config rules, start-up errors, and W&B (offline) / MLflow (file store)
runs that hold the metrics rows after a tiny training run. No network."""

import json
import random
import struct
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from hone.cli import main
from hone.config import parse_config
from hone.config.errors import ConfigError
from hone.track.metrics import read_metrics
from hone.track.trackers import TrackerStartError, start_trackers, tracker_problems


def _raw(tmp_path, logging: dict) -> dict:
    rng = random.Random()
    words = ["plum", "purple", "sky", "blue", "grass", "green"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(8))}) + "\n" for _ in range(16)))
    return {
        "model": {"preset": "tiny-llama", "dtype": "float32"},
        "data": {
            "datasets": [{"path": str(data), "type": "completion"}],
            "sequence_len": 32,
            "val_set_size": 0.25,
            "dataset_prepared_path": str(tmp_path / "prep"),
        },
        "adapter": {"type": "lora", "lora_r": 2},
        "training": {"max_steps": 3, "micro_batch_size": 2, "eval_steps": 2, "output_dir": str(tmp_path / "run")},
        "logging": {"progress_bar": False, **logging},
    }


def _config_error(logging: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(
            {
                "model": {"preset": "tiny-llama"},
                "data": {"datasets": [{"path": "d.jsonl", "type": "completion"}]},
                "logging": logging,
            }
        )
    return str(info.value)


# ---------------------------------------------------------------- config


def test_trackers_default_follows_the_tensorboard_key(tmp_path):
    cfg = parse_config(_raw(tmp_path, {}))
    assert cfg.logging.active_trackers == ["tensorboard"]
    assert parse_config(_raw(tmp_path, {"tensorboard": False})).logging.active_trackers == []
    assert parse_config(_raw(tmp_path, {"trackers": ["mlflow"]})).logging.active_trackers == ["mlflow"]
    assert parse_config(_raw(tmp_path, {"trackers": []})).logging.active_trackers == []


@pytest.mark.parametrize(
    ("logging", "words"),
    [
        ({"trackers": ["wandb", "wandb"]}, ["wandb more than once"]),
        ({"trackers": ["mlflow"], "tensorboard": True}, ["logging.tensorboard: true", "does not list tensorboard"]),
        ({"trackers": ["tensorboard"], "tensorboard": False}, ["logging.tensorboard: false", "lists tensorboard"]),
        ({"wandb": {"project": "p"}}, ["logging.wandb is set", "does not list wandb"]),
        ({"trackers": ["comet"]}, ["comet"]),
    ],
)
def test_contradictions_are_refused(logging, words):
    text = _config_error(logging)
    assert all(w in text for w in words), text


# ---------------------------------------------------------------- cannot start


def _uninstalled(monkeypatch, module: str) -> None:
    """Make ``module`` look uninstalled whether it is or not: a ``None`` entry in sys.modules is
    Python's own way to block an import (``find_spec`` returns None, ``import`` raises)."""
    import sys

    monkeypatch.setitem(sys.modules, module, None)


def test_missing_package_is_an_error_before_training(tmp_path, monkeypatch, capsys):
    _uninstalled(monkeypatch, "mlflow")
    raw = _raw(tmp_path, {"trackers": ["mlflow"]})
    cfg = parse_config(raw)
    [(key, problem)] = tracker_problems(cfg)
    assert key == "logging.trackers" and "mlflow-skinny" in problem and "hone[mlflow]" in problem

    path = tmp_path / "cfg.yml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(path)]) == 2
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the run started
    with pytest.raises(TrackerStartError, match="hone\\[mlflow\\]"):
        start_trackers(cfg, warn=lambda m: None)

    warned = []
    soft = parse_config({**raw, "logging": {**raw["logging"], "tracker_errors": "warn"}})
    assert start_trackers(soft, warn=warned.append) == [] and "training without it" in warned[0]


def test_online_wandb_without_login_is_refused(tmp_path, monkeypatch):
    from hone.track.trackers import _wandb_login_problem

    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    problem = _wandb_login_problem(parse_config(_raw(tmp_path, {"trackers": ["wandb"]})))
    assert problem is not None and "wandb login" in problem and "mode: offline" in problem
    assert _wandb_login_problem(parse_config(_raw(tmp_path, {"trackers": ["wandb"], "wandb": {"mode": "offline"}}))) is None
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert _wandb_login_problem(parse_config(_raw(tmp_path, {"trackers": ["wandb"]}))) is None


# ---------------------------------------------------------------- real runs (offline)


def _train(tmp_path, logging: dict):
    from hone.train.run import run_training

    result = run_training(parse_config(_raw(tmp_path, logging)), device="cpu", console=Console(quiet=True))
    rows = read_metrics(result.metrics_path)
    train = {r["step"]: r["loss"] for r in rows if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert sorted(train) == [1, 2, 3] and sorted(evals) == [0, 2, 3]
    return train, evals


def _wandb_records(run_file: Path):
    """The protobuf records of a ``.wandb`` file (LevelDB log format: 32 KiB blocks of chunks
    with a 7-byte header: crc32, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4), after W&B's
    own 7-byte file header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending, block = run_file.read_bytes(), 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if length == 0 and kind == 0:
            break
        pending += data[pos : pos + length]
        pos += length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_the_metrics_rows(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    train, evals = _train(tmp_path, {"trackers": ["wandb"], "wandb": {"project": "hone-test"}})
    [run_file] = (tmp_path / "wandb-dir" / "wandb").glob("offline-run-*/run-*.wandb")
    logged_train, logged_eval, config, images = {}, {}, "", 0
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            step = int(items["_step"])
            if "train/loss" in items:
                logged_train[step] = json.loads(items["train/loss"])
            if "eval/loss" in items:
                logged_eval[step] = json.loads(items["eval/loss"])
            images += "loss_plot" in items or any(k.startswith("loss_plot") for k in items)
        elif kind == "config":  # later config updates
            config += str(record.config)
        elif kind == "run":  # the run's start, with the config given to wandb.init
            config += str(record.run.config)
    assert logged_train == pytest.approx(train) and logged_eval == pytest.approx(evals)
    assert "max_steps" in config and "optimizations" in config  # resolved config, then the applied list
    assert images == 1


def test_mlflow_file_store_run_holds_the_metrics_rows(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    train, evals = _train(tmp_path, {"trackers": ["mlflow", "tensorboard"], "mlflow": {"tracking_uri": uri, "experiment": "t"}})
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["training.max_steps"] == "3"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert history == pytest.approx(train)
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/loss")} == pytest.approx(evals)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yml", "optimizations.json", "loss.png"} <= artifacts
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "run" / "tensorboard").iterdir())


# ---------------------------------------------------------------- the fan-out


class _Recorder:
    name = "recorder"

    def __init__(self, fail_on_step: int | None = None):
        self.rows, self.finished, self.fail_on_step = [], [], fail_on_step

    def write(self, row):
        if row["step"] == self.fail_on_step:
            raise ConnectionError("server went away")
        self.rows.append(row)

    def finish(self, optimizations, plot, *, failed=False):
        self.finished.append((optimizations, plot, failed))


def _tracker(tmp_path, external, enabled=True):
    from hone.config.logging import LoggingConfig
    from hone.track.tracker import Tracker

    (tmp_path / "optimizations.json").write_text(json.dumps({"applied": [{"name": "attention"}]}))
    return Tracker(
        LoggingConfig(tensorboard=False, progress_bar=False),
        tmp_path,
        Console(quiet=True),
        total_steps=2,
        enabled=enabled,
        external=external,
    )


def test_rank_zero_trackers_get_rows_optimizations_and_plot(tmp_path):
    ok, flaky = _Recorder(), _Recorder(fail_on_step=2)
    tracker = _tracker(tmp_path, [ok, flaky])
    rows = [{"step": 0, "eval_loss": 2.5}, {"step": 1, "loss": 2.0, "lr": 0.1}, {"step": 2, "loss": 1.5, "lr": 0.1}]
    tracker.log_eval(rows[0])
    tracker.log_train(rows[1])
    tracker.log_train(rows[2])
    plot = tracker.close()
    assert ok.rows == rows and flaky.rows == rows[:2]  # the failing one was dropped, the run went on
    assert ok.finished == [({"applied": [{"name": "attention"}]}, plot, False)] and plot.is_file()
    assert flaky.finished == []


def test_other_ranks_log_nothing_to_trackers(tmp_path):
    quiet = _Recorder()
    tracker = _tracker(tmp_path, [quiet], enabled=False)
    tracker.log_train({"step": 1, "loss": 2.0})
    tracker.close()
    assert quiet.rows == [] and quiet.finished == []


def test_the_resolved_config_round_trips(tmp_path):
    from hone.config.loader import dump_config

    for logging in ({"trackers": ["mlflow"], "mlflow": {"experiment": "e"}}, {"tensorboard": False}, {}):
        cfg = parse_config(_raw(tmp_path, logging))
        assert parse_config(yaml.safe_load(dump_config(cfg))) == cfg
