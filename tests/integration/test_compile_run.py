"""``run_training`` with torch.compile on CPU (``aot_eager``: Dynamo and AOTAutograd trace for
real, no code generation): regional and whole-model compilation train exactly like eager, with
and without activation checkpointing; all layers share one graph; the record and the
recompile warning. Inductor itself is covered by tests/unit/test_compile_options.py and, at
real shapes, by tests/gpu/test_compile_gpu.py."""

import io
import json
import random

import pytest
import torch
from rich.console import Console

from hone.config import parse_config
from hone.run_files import OPTIMIZATIONS_FILE
from hone.train.run import run_training

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _train(tmp_path, name, performance=None, *, checkpointing=False, fixed=True, eval_data=False):
    data = tmp_path / ("fixed.jsonl" if fixed else "varied.jsonl")
    if not data.exists():
        rng = random.Random(0)
        rows = [{"input_ids": [rng.randint(5, 90) for _ in range(16 if fixed else rng.randint(6, 24))]} for _ in range(12)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_config(
        {
            "model": {"preset": "tiny-qwen3", "preset_overrides": {"num_hidden_layers": 2}, "dtype": "float32"},
            "data": {
                "datasets": [{"path": str(data), "type": "pretokenized"}],
                "sequence_len": 32,
                "dataset_prepared_path": str(tmp_path / "cache"),
                "val_set_size": 0.2 if eval_data else 0.0,
            },
            "adapter": {"type": "lora", "lora_r": 4},
            "training": {"max_steps": 3, "micro_batch_size": 2, "output_dir": str(tmp_path / name), "seed": 5},
            "optimizer": {"learning_rate": 5e-3},
            "memory": {"gradient_checkpointing": checkpointing},
            "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
            "performance": performance or {},
        }
    )
    out = io.StringIO()
    losses = []
    run_training(cfg, device="cpu", console=Console(file=out, width=400), step_callback=lambda m: losses.append(m.loss))
    record = json.loads((tmp_path / name / OPTIMIZATIONS_FILE).read_text())
    return losses, record, out.getvalue()


REGIONAL = {"torch_compile": True, "torch_compile_backend": "aot_eager"}


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory):
    """Checkpointing recomputes the same values, so one eager run is the reference for all."""
    losses, record, console = _train(tmp_path_factory.mktemp("eager"), "eager")
    applied = [a["name"] for a in record["applied"]]
    assert applied == ["attention", "fused_lora_linear", "loss"] and "compile" not in record and "first step: " in console
    return losses


@pytest.mark.parametrize(
    ("performance", "checkpointing"),
    [(REGIONAL, False), (REGIONAL, True), ({**REGIONAL, "torch_compile_scope": "model"}, False)],
    ids=["regional", "regional+checkpointing", "model"],
)
def test_compiled_run_trains_like_eager_and_records_what_it_applied(tmp_path, eager_losses, performance, checkpointing):
    eager = eager_losses
    compiled, record, console = _train(tmp_path, "compiled", performance, checkpointing=checkpointing)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-5)
    applied = {a["name"]: a for a in record["applied"]}["compile"]
    assert applied["name"] == "compile" and applied["switch"] == "performance.torch_compile"
    details = applied["details"]
    assert details["scope"] == performance.get("torch_compile_scope", "regional") and details["backend"] == "aot_eager"
    assert details["dynamic_shapes"] is False  # every row has 16 tokens
    stats = record["compile"]
    assert stats["counted"] and stats["compiles_after_first_step"] == 0 and stats["recompiles"] == 0, stats
    if details["scope"] == "regional":
        assert details["layers"] == 2 and details["layer_classes"] == ["Qwen3DecoderLayer"]
        assert stats["forward_graphs"] == 1, stats  # one graph, reused by both layers
    assert (
        "optimizations: attention (sdpa, causal, no mask prepared), fused_lora_linear (8 layers), loss (fused_linear_ce), "
        in console
        and ", compile (" in console
    )
    assert "(compilation included)" in console
    assert "torch.compile: 1 forward" in console


def test_varying_lengths_compile_dynamic_shapes_and_late_compiles_are_reported(tmp_path):
    _, record, console = _train(tmp_path, "varied", REGIONAL, fixed=False, eval_data=True)
    assert {a["name"]: a for a in record["applied"]}["compile"]["details"]["dynamic_shapes"] is True
    stats = record["compile"]
    assert stats["eval_graphs"] >= 1 and stats["forward_graphs"] >= 1
    late = stats["compiles_after_first_step"]
    assert ("compiled again after the first step" in console) == (late > 0)


def _cpu_backends() -> list[str]:
    from hone.config.attention import BACKENDS

    return [name for name, b in BACKENDS.items() if b.trains_on_cpu and b.installed and b.works_under_compile]


@pytest.mark.parametrize("attention", _cpu_backends())
def test_packed_rows_compile_static_shapes_once_and_never_recompile(tmp_path, attention):
    rng = random.Random(1)
    data = tmp_path / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"input_ids": [rng.randint(5, 90) for _ in range(rng.randint(3, 20))]}) + "\n" for _ in range(60))
    )
    cfg = parse_config(
        {
            "model": {"preset": "tiny-qwen3", "dtype": "float32", "attn_implementation": attention},
            "data": {
                "datasets": [{"path": str(data), "type": "pretokenized"}],
                "sequence_len": 64,
                "dataset_prepared_path": str(tmp_path / "cache"),
                "sample_packing": True,
            },
            "adapter": {"type": "lora", "lora_r": 4},
            "training": {"max_steps": 4, "micro_batch_size": 1, "output_dir": str(tmp_path / "run")},
            "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
            "performance": REGIONAL,
        }
    )
    run_training(cfg, device="cpu", console=Console(file=io.StringIO()))
    record = json.loads((tmp_path / "run" / OPTIMIZATIONS_FILE).read_text())
    assert {a["name"]: a for a in record["applied"]}["compile"]["details"][
        "dynamic_shapes"
    ] is False  # bins are sequence_len wide
    stats = record["compile"]
    assert stats["forward_graphs"] == 1 and stats["compiles_after_first_step"] == 0, stats


def test_trackers_get_the_record_with_the_compile_counts(tmp_path, monkeypatch):
    """The trackers are closed inside the loop; the record they are handed must already hold
    what the compiler did (it is completed before they close, not after)."""
    import hone.track.tracker as tracker_module

    handed = []
    read = tracker_module.read_optimizations
    monkeypatch.setattr(tracker_module, "read_optimizations", lambda out: handed.append(read(out)) or handed[-1])
    _train(tmp_path, "tracked", REGIONAL)
    assert handed and handed[-1] is not None
    assert handed[-1]["compile"]["counted"] and handed[-1]["compile"]["forward_graphs"] >= 1
