"""model.preset_init: sharp_attention scales attention logits and nothing else."""

import pytest
import torch
from pydantic import ValidationError

from hone.config.model import ModelConfig
from hone.models.errors import ModelError
from hone.models.loader import build_preset_model
from hone.models.preset_init import LOGIT_SCALE, sharpen_attention
from hone.models.tokenizer import load_tokenizer


def _build(preset: str, init: str) -> torch.nn.Module:
    cfg = ModelConfig(preset=preset, preset_init=init, dtype="float32")
    return build_preset_model(cfg, load_tokenizer(cfg), torch.device("cpu"), torch.float32, seed=0)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The first layer's attention logits (pre-softmax, pre-mask), recomputed from its q and k."""
    attn = model.model.layers[0].self_attn
    captured: dict[str, torch.Tensor] = {}
    hooks = [
        attn.q_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("q", o)),
        attn.k_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("k", o)),
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    d = attn.head_dim
    q, k = captured["q"].unflatten(-1, (-1, d)), captured["k"].unflatten(-1, (-1, d))
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    return torch.einsum("bqhd,bkhd->bhqk", q[:, :, :1], k[:, :, :1])


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-llama", "tiny-gpt-oss"])
def test_sharp_attention_multiplies_logits_and_leaves_other_weights(preset: str) -> None:
    plain, sharp = _build(preset, "transformers"), _build(preset, "sharp_attention")
    ids = torch.randint(1, 200, (1, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(sharp, ids), LOGIT_SCALE * _logits(plain, ids), rtol=1e-5, atol=1e-6)
    changed = {n for n, p in plain.named_parameters() if not torch.equal(p, dict(sharp.named_parameters())[n])}
    expected = ("q_norm", "k_norm") if preset == "tiny-qwen3-moe" else ("q_proj", "k_proj")
    assert changed and all(any(part in n for part in expected) for n in changed), sorted(changed)[:4]


def test_preset_init_needs_a_preset(tmp_path) -> None:
    with pytest.raises(ValidationError, match="model.preset_init: sharp_attention only applies together with model.preset"):
        ModelConfig(path=tmp_path, preset_init="sharp_attention")
    with pytest.raises(ValidationError, match="preset_init"):
        ModelConfig(preset="tiny-llama", preset_init="sharp")


def test_sharpening_a_model_without_attention_names_the_key() -> None:
    with pytest.raises(ModelError, match="model.preset_init: sharp_attention"):
        sharpen_attention(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_quantized_projections_are_refused() -> None:
    attn = torch.nn.Module()
    attn.q_proj, attn.k_proj = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    attn.q_proj.weight = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(ModelError, match="quantized"):
        sharpen_attention(attn)
