"""``hone train`` with a preference objective, end to end on the bundled sample
(examples/data/preference_sample.jsonl) and a tiny LoRA model: DPO learns (the reward margin
goes up, held-out accuracy above chance), its metrics reach metrics.jsonl and TensorBoard, and a
run that dies mid-way resumes exactly."""

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from hone.config import parse_config
from hone.track.metrics import read_metrics
from hone.train.checkpoint import list_checkpoints
from hone.train.run import run_training

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "preference_sample.jsonl"


class SimulatedCrash(Exception):
    pass


def _sample(tmp_path: Path) -> Path:
    """The sample's first 40 pairs (the sample may grow; these stay): the runs below are tuned to them."""
    path = tmp_path / "pairs.jsonl"
    if not path.exists():
        path.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:40]))
    return path


def _config(tmp_path: Path, name: str, objective: str = "dpo", **training):
    return parse_config(
        {
            "model": {"preset": "tiny-llama", "dtype": "float32"},
            "data": {
                "datasets": [{"path": str(_sample(tmp_path)), "type": "preference"}],
                "val_set_size": 0.2,
                "sequence_len": 128,
                "dataset_prepared_path": str(tmp_path / "cache"),
            },
            "adapter": {"type": "lora", "lora_r": 16},
            "training": {
                "max_steps": 100,
                "micro_batch_size": 4,
                "eval_steps": 50,
                "objective": objective,
                "preference": {"beta": 0.5},
                "output_dir": str(tmp_path / name),
                **training,
            },
            "optimizer": {"learning_rate": 1e-2, "lr_scheduler": "constant"},
            "logging": {"progress_bar": False, "plot": False},
        }
    )


def _rephrased(tmp_path: Path) -> Path:
    """Every fifth pair of the sample with its question asked another way: held-out prompts
    whose preferred answer the training pairs teach. (A held-out pair about a fact no training
    pair holds is a coin toss for this 0.4M-parameter random model: 0.5, 0.25 and 0.125 accuracy
    over 8 such pairs with seeds 0, 1 and 2, so it cannot show that DPO learned anything.)"""
    path = tmp_path / "rephrased.jsonl"
    rows = [json.loads(line) for line in _sample(tmp_path).read_text().splitlines()[::5]]
    for row in rows:
        row["prompt"] = [dict(row["prompt"][0], content="Please answer: " + row["prompt"][0]["content"])]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_dpo_run_moves_the_reward_margin_up_and_beats_chance_on_held_out_pairs(tmp_path):
    out = io.StringIO()
    cfg = _config(tmp_path, "dpo")
    held_out = cfg.data.model_copy(
        update={
            "val_set_size": 0.0,
            "test_datasets": [cfg.data.datasets[0].model_copy(update={"path": str(_rephrased(tmp_path))})],
        }
    )
    cfg = parse_config({**cfg.model_dump(), "data": held_out.model_dump()})
    result = run_training(cfg, device="cpu", console=Console(file=out, width=250))
    rows = read_metrics(result.metrics_path)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 50, 100]
    margins = [r["rewards/margins"] for r in train]
    assert sum(margins[-25:]) / 25 > sum(margins[:25]) / 25 + 0.2  # the margin went up
    assert evals[0]["eval_rewards/margins"] == 0.0 and evals[0]["eval_loss"] == pytest.approx(0.693147, abs=1e-6)
    # held out, over the evaluations after training began (8 pairs each: one pair moves accuracy by 1/8)
    trained = evals[1:]
    assert sum(e["eval_rewards/margins"] for e in trained) > 0
    assert sum(e["eval_rewards/accuracies"] for e in trained) / len(trained) > 0.5  # above chance
    assert evals[-1]["eval_pairs"] == 8
    for name in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert name in train[-1] and f"eval_{name}" in evals[-1]
    text = out.getvalue()
    assert "| margin " in text and "reward margin" in text and "loss (dpo" in text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(result.output_dir / "tensorboard"))
    events.Reload()
    assert {"train/rewards/margins", "eval/rewards/accuracies"} <= set(events.Tags()["scalars"])


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_a_preference_run_that_dies_resumes_exactly(tmp_path, objective):
    steps = {"max_steps": 6, "micro_batch_size": 2, "gradient_accumulation_steps": 2, "eval_steps": 2}
    straight = run_training(_config(tmp_path, "straight", objective, **steps), device="cpu", console=Console(quiet=True))

    def crash(metrics):
        if metrics.step == 4:  # after the checkpoint of step 3
            raise SimulatedCrash

    with pytest.raises(SimulatedCrash):
        run_training(
            _config(tmp_path, "run", objective, save_steps=3, **steps),
            device="cpu",
            console=Console(quiet=True),
            step_callback=crash,
        )
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [3]
    resumed = run_training(
        _config(tmp_path, "run", objective, save_steps=3, resume="latest", **steps), device="cpu", console=Console(quiet=True)
    )
    assert resumed.steps == 6
    a, b = read_metrics(straight.metrics_path), read_metrics(resumed.metrics_path)
    assert [(r["step"], "eval_loss" in r) for r in a] == [(r["step"], "eval_loss" in r) for r in b]
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "eval_loss", "rewards/margins", "eval_rewards/margins", "logps/chosen", "nll_loss"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-7), (ra["step"], key)
    from safetensors.torch import load_file

    wa = load_file(straight.final_dir / "adapter_model.safetensors")
    wb = load_file(resumed.final_dir / "adapter_model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-6, atol=1e-7, msg=name)


def test_qlora_dpo_switches_the_adapter_off_around_the_4_bit_base(tmp_path):
    """QLoRA: the reference is the 4-bit base with the adapter off. At step 1 the fresh adapter
    (B = 0) makes the policy the reference (loss log 2, rewards 0); afterwards the rewards move,
    which they could not if the reference pass kept the adapter on."""
    pytest.importorskip("torchao", reason="NF4 needs the optional 'quant' extra (torchao)")
    cfg = _config(tmp_path, "qlora", max_steps=4, eval_steps=None)
    raw = cfg.model_dump(mode="json")
    raw["model"].update(quantize="nf4", preset_overrides={"hidden_size": 128, "intermediate_size": 256, "head_dim": 32})
    raw["adapter"]["lora_target_modules"] = "all-linear"
    result = run_training(parse_config(raw), device="cpu", console=Console(quiet=True))
    import json

    record = json.loads((result.output_dir / "optimizations.json").read_text())
    assert "quantize" in [a["name"] for a in record["applied"]]
    train = [r for r in read_metrics(result.metrics_path) if "loss" in r]
    assert train[0]["loss"] == pytest.approx(0.693147, abs=1e-6) and train[0]["rewards/margins"] == 0.0
    assert all(r["rewards/chosen"] != 0.0 for r in train[1:])
