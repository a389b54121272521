"""DPO of a full fine-tune: the reference log-probs precomputed once with the initial weights,
kept in the run directory, read back (not recomputed) by a resumed run."""

import os
import random

import pytest
import torch
from rich.console import Console

from hone.data.pairs import collate_pairs
from hone.models.structure import causal_lm_parts
from hone.run_files import REFERENCE_FILE
from hone.runtime.pair_loss import PairLoss
from hone.runtime.step import forward_hidden
from hone.testing import plan_hooks, tiny_config, tiny_llama
from hone.track.metrics import read_metrics
from hone.train.checkpoint import list_checkpoints
from hone.train.loop import train_loop

SEED = int(os.environ.get("HONE_TEST_SEED", random.randrange(10_000)))  # fresh each session; fix it to reproduce


class Crash(Exception):
    pass


def _pairs(n: int, seed: int) -> list[dict[str, list[int]]]:
    gen = random.Random(seed)

    def ids(low: int, high: int) -> list[int]:
        return [gen.randrange(1, 97) for _ in range(gen.randint(low, high))]

    return [{"prompt_ids": ids(2, 9), "chosen_ids": ids(1, 8), "rejected_ids": ids(1, 8)} for _ in range(n)]


def _model():
    model = tiny_llama(SEED)
    model.config._attn_implementation = "sdpa"
    return model


def _run(out, data, *, resume_from=None, callback=None, **training):
    cfg = tiny_config(
        out,
        data={"val_set_size": 0.1},
        training={"max_steps": 5, "micro_batch_size": 2, "eval_steps": 5, "objective": "dpo", **training},
        optimizer={"learning_rate": 1e-2, "lr_scheduler": "constant"},
    )
    model = _model()
    return model, _train(model, cfg, data, resume_from, callback)


def _train(model, cfg, data, resume_from, callback):
    """``cfg``'s DPO run of ``model`` on ``data`` (train, eval) on the CPU; its metrics."""
    train_loop(
        model,
        data[0],
        data[1],
        cfg,
        device=torch.device("cpu"),
        pad_id=0,
        console=Console(quiet=True),
        hooks=plan_hooks(model, cfg),
        resume_from=resume_from,
        step_callback=callback,
    )
    return read_metrics(cfg.training.output_dir / "metrics.jsonl")


def test_a_full_fine_tune_precomputes_the_initial_models_log_probs_and_a_resume_reads_them_back(tmp_path):
    from safetensors.torch import load_file

    data = (_pairs(16, SEED), _pairs(3, SEED + 1))
    straight, rows = _run(tmp_path / "straight", data)
    tables = load_file(str(tmp_path / "straight" / REFERENCE_FILE))
    assert tables["train"].shape == (16, 2) and tables["eval"].shape == (3, 2)
    initial = _model().eval()
    decoder, head = causal_lm_parts(initial)
    with torch.no_grad():
        for split, pairs in (("train", data[0]), ("eval", data[1])):
            batch = collate_pairs(pairs, pad_id=0)
            from hone.models.attention.layout import layout_for

            batch = batch.with_attention(layout_for(initial))
            logps = PairLoss("dpo", 0.1).logps(forward_hidden(decoder, batch), head, batch)
            torch.testing.assert_close(
                tables[split], torch.stack([logps[: 16 if split == "train" else 3], logps[16 if split == "train" else 3 :]], 1)
            )
    train = [r for r in rows if "loss" in r]
    assert train[0]["loss"] == pytest.approx(0.693147, abs=1e-6) and train[0]["rewards/margins"] == 0.0  # policy == reference
    assert train[-1]["rewards/margins"] != 0.0

    def crash(metrics):
        if metrics.step == 4:
            raise Crash

    with pytest.raises(Crash):
        _run(tmp_path / "run", data, callback=crash, save_steps=3)
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [3]
    resumed, resumed_rows = _run(tmp_path / "run", data, resume_from=tmp_path / "run" / "checkpoints" / "step-3", save_steps=3)
    for a, b in zip(rows, resumed_rows, strict=True):
        for key in ("loss", "eval_loss", "rewards/margins", "eval_rewards/margins"):
            if key in a:  # recomputing the reference from the step-3 weights would change every one of these
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (a["step"], key)
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def test_a_resume_without_its_reference_file_is_refused(tmp_path):
    from hone.train.reference import ReferenceError

    data = (_pairs(8, SEED), None)

    def crash(metrics):
        if metrics.step == 3:  # after the checkpoint of step 2
            raise Crash

    with pytest.raises(Crash):
        _run(tmp_path / "run", data, callback=crash, save_steps=2, eval_steps=None)
    (tmp_path / "run" / REFERENCE_FILE).unlink()
    with pytest.raises(ReferenceError, match="reference_logps.safetensors is missing"):
        _run(tmp_path / "run", data, resume_from=tmp_path / "run" / "checkpoints" / "step-2", eval_steps=None)


@pytest.mark.parametrize(
    "adapter, training, expected",
    [
        ("none", {}, "precomputed"),  # a full fine-tune: no adapter to switch off, no second copy
        ("lora", {}, "adapter_disabled"),  # one pass: the same cost either way, training starts at once
        ("lora", {"num_epochs": 1}, "adapter_disabled"),
        ("lora", {"num_epochs": 1.5}, "precomputed"),  # computed once instead of every pass
        ("lora", {"num_epochs": 3}, "precomputed"),
        ("lora", {"max_steps": 500}, "adapter_disabled"),  # passes unknown before the data is
        ("lora", {"num_epochs": 3, "preference": {"reference": "adapter_disabled"}}, "adapter_disabled"),
        ("none", {"preference": {"reference": "precomputed"}}, "precomputed"),
    ],
)
def test_reference_auto_precomputes_for_full_finetunes_and_lora_over_several_epochs(adapter, training, expected):
    from hone.config import parse_config

    raw = {
        "model": {"preset": "tiny-llama"},
        "data": {"datasets": [{"path": "pairs.jsonl", "type": "preference"}]},
        "adapter": {"type": adapter},
        "training": {"objective": "dpo", **training},
    }
    assert parse_config(raw).preference_reference == expected
    raw["training"]["objective"] = "orpo"
    raw["training"].pop("preference", None)
    assert parse_config(raw).preference_reference is None  # ORPO has no reference


def _lora_run(out, data, reference, *, resume_from=None, callback=None, **training):
    """A LoRA DPO run as hone trains one: the adapter starts at zero (B = 0)."""
    from hone.config.adapter import AdapterConfig
    from hone.models.adapters import apply_adapter

    cfg = tiny_config(
        out,
        adapter={"type": "lora", "lora_r": 4},
        training={"max_steps": 5, "micro_batch_size": 2, "objective": "dpo", "preference": {"reference": reference}, **training},
        optimizer={"learning_rate": 1e-2, "lr_scheduler": "constant"},
    )
    model = _model()
    # PEFT draws lora_A from the global generator: seeded here, not left where the previous test
    # (or none, the process's default seed) left it, so that two runs of one test start alike
    torch.manual_seed(SEED)
    return _train(apply_adapter(model, AdapterConfig(type="lora", lora_r=4)), cfg, (data, None), resume_from, callback)


def test_lora_precomputed_trains_as_the_steps_reference_and_a_resume_without_the_file_rebuilds_it(tmp_path):
    """Under LoRA the precomputed table is the model with its adapter off: the same losses as the
    step's reference. A run resumed as precomputed without the file (it began with the step's
    reference, e.g. one epoch extended to three) computes the table with the adapter switched
    off: the initial model's, not the trained one's."""
    from safetensors.torch import load_file

    data = _pairs(8, SEED)
    in_step = [r["loss"] for r in _lora_run(tmp_path / "in-step", data, "adapter_disabled") if "loss" in r]
    ahead = [r["loss"] for r in _lora_run(tmp_path / "ahead", data, "precomputed") if "loss" in r]
    assert ahead == pytest.approx(in_step, rel=1e-5, abs=1e-7) and in_step[-1] != pytest.approx(in_step[0])
    fresh = load_file(str(tmp_path / "ahead" / REFERENCE_FILE))["train"]

    def crash(metrics):
        if metrics.step == 3:  # after the checkpoint of step 2
            raise Crash

    with pytest.raises(Crash):
        _lora_run(tmp_path / "run", data, "adapter_disabled", callback=crash, save_steps=2)
    assert not (tmp_path / "run" / REFERENCE_FILE).exists()
    resumed = _lora_run(tmp_path / "run", data, "precomputed", resume_from=tmp_path / "run" / "checkpoints" / "step-2")
    torch.testing.assert_close(load_file(str(tmp_path / "run" / REFERENCE_FILE))["train"], fresh, rtol=1e-6, atol=1e-6)
    assert [r["loss"] for r in resumed if "loss" in r][-2:] == pytest.approx(in_step[-2:], rel=1e-5, abs=1e-7)
