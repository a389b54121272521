"""Launching: ``hone train CFG --nproc-per-node 2`` (re-executed under torchrun) trains once, with
rank 0 alone writing and printing; ``torchrun -m hone train`` works too; a rank that fails at
start-up stops every rank with its message and no hang, and the launch ends with one line naming
it (not torchrun's traceback); refused launches exit 2 before loading."""

import json
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml
from dist_launch import REPO, TIMEOUT_S, WORKER, child_env, run, run_worker, torchrun

from hone.track.metrics import read_metrics

WORDS = ["red", "green", "blue", "lemon", "lime", "fox", "dog", "quick", "lazy", "yellow"]


def _config(tmp_path, **training) -> "Path":  # noqa: F821
    rng = random.Random()
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14)))}) + "\n" for _ in range(24))
    )
    cfg = {
        "model": {"preset": "tiny-llama", "dtype": "float32"},
        "data": {
            "datasets": [{"path": str(data), "type": "completion"}],
            "val_set_size": 0.25,
            "sequence_len": 64,
            "dataset_prepared_path": str(tmp_path / "cache"),
        },
        "adapter": {"type": "lora", "lora_r": 4},
        "training": {"max_steps": 2, "micro_batch_size": 2, "output_dir": str(tmp_path / "run"), **training},
        "optimizer": {"learning_rate": 5e-3},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    path = tmp_path / "cfg.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_nproc_per_node_trains_once_with_rank_zero_writing(tmp_path):
    proc = run([sys.executable, "-m", "hone.cli", "train", str(_config(tmp_path)), "--nproc-per-node", "2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "run"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]  # one writer: no row twice
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 2]
    assert (run_dir / "final" / "adapter_model.safetensors").is_file()
    assert (run_dir / "checkpoints" / "step-2" / "COMPLETE").is_file()
    applied = json.loads((run_dir / "optimizations.json").read_text())["applied"]
    ddp = [a for a in applied if a["name"] == "ddp"]
    assert ddp and ddp[0]["details"]["processes"] == 2 and ddp[0]["details"]["backend"] == "gloo"
    assert proc.stdout.count("trainable parameters:") == 1  # rank 1 is quiet
    assert "ddp (2 processes, gloo)" in proc.stdout
    assert "x 2 processes" in proc.stdout  # the plan counts the global batch


def test_a_rank_failing_at_start_up_stops_every_rank_with_its_message(tmp_path):
    # through run_training: the run directory holds another run, which rank 0 (its owner) finds
    cfg = _config(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    proc = run(torchrun("-m", "hone", "train", str(cfg)))
    assert proc.returncode != 0
    assert "error: [rank 0] training.output_dir" in proc.stderr
    assert "already holds a run that stopped before its first checkpoint" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()

    # the agreement itself: rank 1 fails inside a start-up phase, rank 0 stops with its message
    out = tmp_path / "agree"
    run_worker("startup_failure", out, 0)
    rank0 = json.loads((out / "outcome-rank0.json").read_text())
    rank1 = json.loads((out / "outcome-rank1.json").read_text())
    assert rank1["result"] == "HoneError" and "shard-1.jsonl is missing" in rank1["message"]
    assert rank0["result"] == "PeerFailed" and rank0["exit_code"] == 2 and not rank0["quiet"]
    assert "rank 1 of 2 failed" in rank0["message"] and "shard-1.jsonl is missing" in rank0["message"]


def test_a_failed_launch_ends_with_the_first_failed_rank_not_torchruns_traceback(tmp_path):
    # the run directory holds another run: rank 0 refuses it at start-up, rank 1 stops with it
    cfg = _config(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    proc = run([sys.executable, "-m", "hone", "train", str(cfg), "--nproc-per-node", "2"])
    assert proc.returncode == 2, proc.stderr[-4000:]  # the ranks' own code (torchrun exits 1)
    assert "error: [rank 0] training.output_dir" in proc.stderr  # the cause, as the rank said it
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"error: rank [01] failed first \(exit code 2\)(; rank [01] stopped after it)?: its error is above", last)
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr


def test_sigterm_to_the_launcher_stops_the_ranks_after_a_checkpoint_and_exits_143(tmp_path):
    # `kill PID` of `hone train --nproc-per-node 2`: torchrun's agent passes the signal on, each
    # rank finishes its step and saves; the launch ends quietly with the signal's exit status
    cfg = _config(tmp_path, max_steps=10_000, save_steps=10_000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hone", "train", str(cfg), "--nproc-per-node", "2"],
        env=child_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.monotonic() + TIMEOUT_S
    while not (metrics.exists() and any(r.get("step", 0) >= 2 for r in read_metrics(metrics))):
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        assert time.monotonic() < deadline, "no step 2 in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 143, stderr[-4000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-4000:]
    complete = [p for p in (tmp_path / "run" / "checkpoints").glob("step-*") if (p / "COMPLETE").is_file()]
    assert complete, f"no checkpoint saved on the way out:\n{stderr[-4000:]}"


def test_a_rank_failing_mid_run_stops_the_others_without_a_hang(tmp_path):
    # rank 0 is left waiting in step 3's all-reduce; the lost peer ends it (and torchrun the rest)
    tmp_path.mkdir(exist_ok=True)
    proc = run(torchrun(str(WORKER), "midrun_failure", str(tmp_path), "1"))
    assert proc.returncode != 0
    assert "simulated failure of rank 1 at step 2" in proc.stderr


# torchrun's form is `long` (~23 s on 2 cores): each rank refuses as hone's launcher does first
@pytest.mark.parametrize("form", ["hone --nproc-per-node", pytest.param("torchrun", marks=pytest.mark.long)])
def test_strategy_none_on_two_processes_is_refused(tmp_path, form):
    cfg = str(_config(tmp_path))
    args = ["train", cfg, "--set", "distributed.strategy=none"]
    if form == "torchrun":
        proc = run(torchrun("-m", "hone", *args))
        assert proc.returncode != 0
    else:
        proc = run([sys.executable, "-m", "hone", *args, "--nproc-per-node", "2"])
        assert proc.returncode == 2
    assert "distributed.strategy: 'none' refuses to run on more than one process" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_data_too_small_for_the_global_batch_is_refused_before_the_model_loads(tmp_path):
    proc = run(
        [
            sys.executable,
            "-m",
            "hone",
            "train",
            str(_config(tmp_path)),
            "--set",
            "training.micro_batch_size=12",
            "--nproc-per-node",
            "2",
        ]
    )
    assert proc.returncode != 0
    assert "x 2 processes = 24" in proc.stderr and "run on fewer processes" in proc.stderr
    assert "model:" not in proc.stdout  # refused before the model loaded
    assert not (tmp_path / "run" / "config.yml").exists()  # rank 0's start was undone
