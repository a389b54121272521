"""torch.compile through ``run_training`` on CUDA with Inductor: regional and whole-model,
with and without activation checkpointing, an Inductor option and CUDA graphs. Each run must
train like the eager run (bf16 tolerance), compile one graph shared by every layer, and never
recompile after the first step on fixed-shape data. Skipped without a GPU."""

import json
import random

import pytest
import torch
from rich.console import Console

from hone.config import parse_config
from hone.train.run import run_training
from hone.transforms.inductor import read_option

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


def _train(tmp_path, name, performance=None, checkpointing=False, rows=16, length=64, **sections):
    rng = random.Random(0)
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text(
            "".join(json.dumps({"input_ids": [rng.randint(5, 250) for _ in range(length)]}) + "\n" for _ in range(rows))
        )
    raw = {
        "model": {"preset": "tiny-qwen3", "preset_overrides": {"num_hidden_layers": 4}, "dtype": "bfloat16"},
        "data": {
            "datasets": [{"path": str(data), "type": "pretokenized"}],
            "sequence_len": length,
            "dataset_prepared_path": str(tmp_path / "cache"),
        },
        "adapter": {"type": "lora", "lora_r": 8},
        "training": {"max_steps": 6, "micro_batch_size": 2, "output_dir": str(tmp_path / name), "seed": 3},
        "optimizer": {"learning_rate": 1e-3, "lr_scheduler": "constant"},
        "memory": {"gradient_checkpointing": checkpointing},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "performance": performance or {"torch_compile": False},
    }
    for key, section in sections.items():
        raw[key] = {**raw[key], **section}
    cfg = parse_config(raw)
    losses = []
    result = run_training(cfg, device="cuda", console=Console(quiet=True), step_callback=lambda m: losses.append(m.loss))
    record = json.loads((tmp_path / name / "optimizations.json").read_text())
    record["last_eval_loss"] = result.last_eval_loss
    return losses, record


@pytest.mark.parametrize(
    ("scope", "checkpointing", "options"),
    [
        ("regional", False, {}),
        ("regional", True, {}),
        ("model", False, {}),
        ("regional", False, {"coordinate_descent_tuning": True, "triton.cudagraphs": True}),
    ],
)
def test_compiled_training_matches_eager_without_recompiles(tmp_path, scope, checkpointing, options):
    eager, record = _train(tmp_path, "eager", checkpointing=checkpointing)
    assert "compile" not in [a["name"] for a in record["applied"]]
    perf = {"torch_compile": True, "torch_compile_scope": scope}
    if options:
        perf["torch_compile_options"] = options
    compiled, record = _train(tmp_path, "compiled", perf, checkpointing=checkpointing)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=2e-2, atol=2e-2)
    applied = {a["name"]: a for a in record["applied"]}["compile"]
    assert applied["details"]["scope"] == scope and applied["details"]["options"] == options
    stats = record["compile"]
    assert stats["compiles_after_first_step"] == 0 and stats["recompiles"] == 0, stats
    if scope == "regional":
        assert applied["details"]["layers"] == 4
        assert stats["forward_graphs"] == 1, stats  # one graph, reused by all four layers
    for key in options:  # applied to hone's compilation only, never left in the global config
        assert read_option(key) is False


def test_cuda_graphs_survive_eval_passes_without_grad(tmp_path):
    """Eval between steps runs the compiled layers without grad. Left to themselves, cudagraph
    trees start a new generation at each such layer and may overwrite the output the next layer
    reads (a DPO step's reference pass failed so on an H200); hone marks one generation per pass
    (hone.runtime.step.begin_pass). Training and eval losses match eager's."""
    evals = {"data": {"val_set_size": 0.25}, "training": {"eval_steps": 2}}
    eager, record = _train(tmp_path, "eager", **evals)
    graphs, graphed = _train(tmp_path, "graphs", {"torch_compile": True, "cuda_graphs": True}, **evals)
    assert {a["name"]: a for a in graphed["applied"]}["compile"]["details"]["cuda_graphs"] is True
    torch.testing.assert_close(torch.tensor(graphs), torch.tensor(eager), rtol=2e-2, atol=2e-2)
    assert graphed["last_eval_loss"] == pytest.approx(record["last_eval_loss"], rel=2e-2)
    assert graphed["compile"]["graph_recordings"] > 0  # the watch hears Inductor's recordings on this torch


def _train_packed(tmp_path, name, attention, performance, micro_batch_size=1, **sections):
    rng = random.Random(1)
    data = tmp_path / "docs.jsonl"
    if not data.exists():
        # Some documents fill a packed row on their own: a batch of only those looks unpacked to
        # transformers, which is where a mask of another kind (and a recompile) could sneak in.
        lengths = [rng.randint(8, 60) for _ in range(96)] + [256] * 12
        data.write_text("".join(json.dumps({"input_ids": [rng.randint(5, 250) for _ in range(n)]}) + "\n" for n in lengths))
    raw = {
        "model": {"preset": "tiny-llama", "dtype": "bfloat16", **attention},
        "data": {
            "datasets": [{"path": str(data), "type": "pretokenized"}],
            "sequence_len": 256,
            "sample_packing": True,
            "dataset_prepared_path": str(tmp_path / "cache"),
        },
        "adapter": {"type": "lora", "lora_r": 8},
        "training": {"max_steps": 12, "micro_batch_size": micro_batch_size, "output_dir": str(tmp_path / name), "seed": 5},
        "optimizer": {"learning_rate": 1e-3, "lr_scheduler": "constant"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
        "performance": performance,
    }
    for key, section in sections.items():
        raw[key] = {**raw[key], **section}
    losses = []
    result = run_training(
        parse_config(raw), device="cuda", console=Console(quiet=True), step_callback=lambda m: losses.append(m.loss)
    )
    record = json.loads((tmp_path / name / "optimizations.json").read_text())
    record["last_eval_loss"] = result.last_eval_loss
    return losses, record


_PACKED_ATTENTION = {
    "sdpa-varlen": {"attn_implementation": "sdpa", "sdpa_varlen": True},
    "sdpa-mask": {"attn_implementation": "sdpa", "sdpa_varlen": False},
    "flex": {"attn_implementation": "flex_attention"},
}


@pytest.mark.parametrize(
    ("attention", "scope"),
    [("sdpa-varlen", "regional"), ("sdpa-mask", "regional"), ("flex", "regional"), ("sdpa-varlen", "model"), ("flex", "model")],
)
def test_compile_with_packing_matches_eager(tmp_path, attention, scope):
    """Packed rows (one fixed shape) with each GPU attention backend: the compiled run trains
    like eager and compiles nothing after the first step."""
    attention = _PACKED_ATTENTION[attention]
    eager, _ = _train_packed(tmp_path, "eager", attention, {"torch_compile": False})
    compiled, record = _train_packed(tmp_path, "compiled", attention, {"torch_compile": True, "torch_compile_scope": scope})
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=2e-2, atol=2e-2)
    assert all(torch.isfinite(torch.tensor(compiled)))
    stats = record["compile"]
    assert stats["compiles_after_first_step"] == 0 and stats["recompiles"] == 0, stats


@pytest.mark.parametrize("attention", sorted(_PACKED_ATTENTION))
def test_cuda_graphs_with_packing_match_eager(tmp_path, attention):
    """CUDA graphs over packed rows: every micro-batch's boundaries count one number of
    segments (the varlen kernel skips the empty ones; the masks never read them), so the
    graphs replay one recording; training and eval (packed too) match eager's, nothing
    compiles after the first step."""
    attention = _PACKED_ATTENTION[attention]
    evals = {"data": {"val_set_size": 0.1, "eval_sample_packing": True}, "training": {"eval_steps": 6}}
    eager, record = _train_packed(tmp_path, "eager", attention, {"torch_compile": False}, micro_batch_size=2, **evals)
    graphs, graphed = _train_packed(
        tmp_path, "graphs", attention, {"torch_compile": True, "cuda_graphs": True}, micro_batch_size=2, **evals
    )
    assert {a["name"]: a for a in graphed["applied"]}["compile"]["details"]["cuda_graphs"] is True
    torch.testing.assert_close(torch.tensor(graphs), torch.tensor(eager), rtol=2e-2, atol=2e-2)
    assert graphed["last_eval_loss"] == pytest.approx(record["last_eval_loss"], rel=2e-2)
    stats = graphed["compile"]
    assert stats["compiles_after_first_step"] == 0, stats
