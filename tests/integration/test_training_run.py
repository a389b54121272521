"""``run_training`` end to end: config + data file -> tokenizer, data, model, loop, outputs."""

import io
import json
import os
import random
import signal

import pytest
from rich.console import Console

from hone.config import parse_config
from hone.config.loader import load_config
from hone.track.metrics import read_metrics
from hone.train.run import OutputDirInUse, run_training

pytest.importorskip("hone.data.prepare", reason="hone.data (prepare_data) has not landed")
pytest.importorskip("hone.models.tokenizer", reason="hone.models.tokenizer has not landed")


def _config(tmp_path, **training):
    words = ["red", "green", "blue", "lemon", "lime", "fox", "dog", "quick", "lazy", "yellow"]
    rng = random.Random()
    rows = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))} for _ in range(30)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return parse_config(
        {
            "model": {"preset": "tiny-llama", "dtype": "float32"},
            "data": {
                "datasets": [{"path": str(data), "type": "completion"}],
                "val_set_size": 0.2,
                "sequence_len": 64,
                "dataset_prepared_path": str(tmp_path / "cache"),
            },
            "adapter": {"type": "lora", "lora_r": 4},
            "training": {"max_steps": 4, "micro_batch_size": 2, "output_dir": str(tmp_path / "run"), **training},
            "optimizer": {"learning_rate": 5e-3, "lr_scheduler": "cosine"},
            "logging": {"progress_bar": False},
        }
    )


def test_a_run_leaves_config_metrics_plot_events_checkpoint_and_adapter(tmp_path):
    cfg = _config(tmp_path, eval_steps=2)
    out = io.StringIO()
    steps_seen = []
    result = run_training(cfg, device="cpu", console=Console(file=out, width=200), step_callback=steps_seen.append)
    run = tmp_path / "run"
    assert (result.steps, result.total_steps, result.interrupted, result.skipped_steps) == (4, 4, None, 0)
    assert [m.step for m in steps_seen] == [1, 2, 3, 4] and all(m.step_time_s > 0 for m in steps_seen)
    assert load_config(run / "config.yml") == cfg
    assert result.final_dir == run / "final" and (run / "final" / "adapter_model.safetensors").exists()
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").iterdir())
    assert result.last_checkpoint == run / "checkpoints" / "step-4"
    rows = read_metrics(result.metrics_path)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 2, 4]
    assert result.first_eval_loss == rows[0]["eval_loss"] and result.last_eval_loss == rows[-1]["eval_loss"]
    text = out.getvalue()
    assert "trainable parameters:" in text and "data:" in text
    assert "Finished: step 4/4" in text and "eval loss:" in text and "final/" in text
    assert f"checkpoint: step 4 saved to {run / 'checkpoints' / 'step-4'}" in text  # a line per checkpoint
    assert "| rss " in text  # the CPU's memory on each step's line

    with pytest.raises(OutputDirInUse):  # the same output_dir again without resume
        run_training(cfg, device="cpu", console=Console(quiet=True))


def test_a_run_without_outputs_writes_no_checkpoint_and_no_final_model(tmp_path):
    """``hone bench`` times the steps only (a 30B full fine-tune's checkpoint and model filled a disk)."""
    cfg = _config(tmp_path, save_steps=2)
    out = io.StringIO()
    result = run_training(cfg, device="cpu", console=Console(file=out, width=200), save_outputs=False)
    run = tmp_path / "run"
    assert (result.steps, result.final_dir, result.last_checkpoint) == (4, None, None)
    assert not (run / "final").exists() and not (run / "checkpoints").exists()
    assert [r["step"] for r in read_metrics(result.metrics_path) if "loss" in r] == [1, 2, 3, 4]
    assert "Finished: step 4/4" in out.getvalue() and "final/" not in out.getvalue()


def test_sigterm_stops_with_a_checkpoint_and_resume_finishes_the_run(tmp_path):
    cfg = _config(tmp_path)
    previous = signal.getsignal(signal.SIGTERM)

    def term_at_2(metrics):
        if metrics.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    out = io.StringIO()
    stopped = run_training(cfg, device="cpu", console=Console(file=out, width=200), step_callback=term_at_2)
    assert (stopped.interrupted, stopped.steps, stopped.final_dir) == ("SIGTERM", 2, None)
    assert not (tmp_path / "run" / "final").exists()
    assert stopped.last_checkpoint == tmp_path / "run" / "checkpoints" / "step-2"
    assert "training.resume=latest" in out.getvalue()
    assert signal.getsignal(signal.SIGTERM) is previous

    resumed = run_training(
        cfg.model_copy(update={"training": cfg.training.model_copy(update={"resume": "latest"})}),
        device="cpu",
        console=Console(quiet=True),
    )
    assert (resumed.steps, resumed.interrupted) == (4, None)
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").exists()
    assert [r["step"] for r in read_metrics(resumed.metrics_path) if "loss" in r] == [1, 2, 3, 4]
