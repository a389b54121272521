"""The fused experts tensors of transformers 5 assembled from a checkpoint of one tensor per
expert (hone.models.expert_keys), as transformers fuses them when it loads."""

import pytest
import torch
from safetensors import safe_open

from hone.models.errors import ModelError
from hone.models.expert_keys import expert_rows, per_expert_sources

PREFIX = "model.layers.3.mlp.experts."


def _per_expert_checkpoint(experts: int = 4, inter: int = 2, hidden: int = 3) -> dict[str, torch.Tensor]:
    """gate rows hold +(e + 1), up rows -(e + 1), down rows 10 * (e + 1): a swap or a wrong expert shows."""
    tensors = {}
    for e in range(experts):
        tensors[f"{PREFIX}{e}.gate_proj.weight"] = torch.full((inter, hidden), e + 1.0)
        tensors[f"{PREFIX}{e}.up_proj.weight"] = torch.full((inter, hidden), -(e + 1.0))
        tensors[f"{PREFIX}{e}.down_proj.weight"] = torch.full((hidden, inter), 10.0 * (e + 1))
    return tensors


def test_gate_up_is_each_experts_gate_then_up_rows_for_the_experts_asked():
    tensors = _per_expert_checkpoint()
    sources = per_expert_sources(PREFIX + "gate_up_proj", tensors)
    assert sources is not None
    rows = expert_rows(sources, first=1, count=2, read=tensors.__getitem__)
    assert rows.shape == (2, 4, 3)  # [experts, 2I, H]
    for i, e in enumerate((1, 2)):
        assert torch.equal(rows[i, :2], torch.full((2, 3), e + 1.0)), "gate first"
        assert torch.equal(rows[i, 2:], torch.full((2, 3), -(e + 1.0))), "then up"


def test_down_is_the_experts_stacked():
    tensors = _per_expert_checkpoint()
    rows = expert_rows(per_expert_sources(PREFIX + "down_proj", tensors), first=2, count=2, read=tensors.__getitem__)
    assert rows.shape == (2, 3, 2)
    assert torch.equal(rows[:, 0, 0], torch.tensor([30.0, 40.0]))


def test_no_sources_where_the_checkpoint_has_no_per_expert_tensors():
    tensors = _per_expert_checkpoint()
    assert per_expert_sources("model.layers.0.mlp.experts.gate_up_proj", tensors) is None  # another layer
    assert per_expert_sources(PREFIX.replace("experts.", "gate.weight"), tensors) is None  # not an experts tensor


def test_a_transformers_save_reads_back_as_the_models_fused_experts(tmp_path):
    """transformers 5's save_pretrained writes one tensor per expert; the table puts them back
    exactly where the model holds them."""
    from hone.testing import save_tiny_model, tiny_model, tiny_tokenizer

    model = tiny_model("tiny-qwen3-moe", tiny_tokenizer(), seed=3)
    path = save_tiny_model(tmp_path / "m", "tiny-qwen3-moe", tiny_tokenizer(), seed=3)
    fused = {n: p for n, p in model.named_parameters() if ".experts." in n}
    assert fused and all(n.endswith(("gate_up_proj", "down_proj")) for n in fused)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert not keys & set(fused)  # per-expert keys only
        for name, param in fused.items():
            sources = per_expert_sources(name, keys)
            assert sources is not None, name
            assert torch.equal(expert_rows(sources, 0, param.shape[0], f.get_tensor), param.detach()), name


def test_experts_of_mismatched_shapes_are_refused_naming_the_tensors():
    tensors = _per_expert_checkpoint()
    tensors[f"{PREFIX}2.up_proj.weight"] = torch.zeros(2, 5)
    with pytest.raises(ModelError, match=r"expert 2's tensors .*up_proj.weight' \(2, 5\)"):
        expert_rows(per_expert_sources(PREFIX + "gate_up_proj", tensors), 0, 4, tensors.__getitem__)
    tensors[f"{PREFIX}2.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ModelError, match=r"expert 2's .*\(expert 0's make \(4, 3\)\)"):
        expert_rows(per_expert_sources(PREFIX + "gate_up_proj", tensors), 0, 4, tensors.__getitem__)
