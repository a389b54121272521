"""Saving the final output (atomically, safetensors) and the trainable-weights round trip."""

import os
import stat
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

import hone.models.save as save_module
from hone.config import parse_config
from hone.errors import HoneError
from hone.models.loader import load_model
from hone.models.save import load_trainable_state_dict, save_final, trainable_state_dict
from hone.testing import save_tiny_model, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tokenizer) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("base") / "qwen3", "tiny-qwen3", tokenizer, seed=11)


def loaded(base_dir, tokenizer, adapter="lora"):
    cfg = parse_config(
        {
            "model": {"path": str(base_dir), "dtype": "float32"},
            "data": {"datasets": [{"path": "d.jsonl", "type": "completion"}]},
            "adapter": adapter,
        }
    )
    model = load_model(cfg, tokenizer, "cpu").model
    with torch.no_grad():  # stand-in for training: move every trainable weight
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    return model.eval(), cfg.adapter


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def test_lora_final_is_a_peft_adapter_with_identical_logits(tmp_path, base_dir, tokenizer):
    model, adapter = loaded(base_dir, tokenizer, adapter={"lora_modules_to_save": ["lm_head"]})
    ids = torch.randint(0, len(tokenizer), (2, 10))
    expected = logits(model, ids)
    out = save_final(model, tokenizer, tmp_path / "final", adapter)
    names = files(out)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, str(out)).eval()
    torch.testing.assert_close(logits(reloaded, ids), expected, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(str(out)).encode("a lemon") == tokenizer.encode("a lemon")


def test_full_final_is_a_model_directory_with_identical_logits(tmp_path, base_dir, tokenizer):
    model, adapter = loaded(base_dir, tokenizer, adapter="none")
    ids = torch.randint(0, len(tokenizer), (2, 10))
    expected = logits(model, ids)
    out = save_final(model, tokenizer, tmp_path / "final", adapter)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files(out)
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    torch.testing.assert_close(logits(reloaded, ids), expected, rtol=0, atol=0)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_final_files_get_the_umasks_mode_not_0600(tmp_path, base_dir, tokenizer, umask):
    """safetensors creates its file 0600; the published weights follow the umask like the rest."""
    model, adapter = loaded(base_dir, tokenizer)
    previous = os.umask(umask)
    try:
        out = save_final(model, tokenizer, tmp_path / "final", adapter)
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()}
    assert modes["adapter_model.safetensors"] == 0o666 & ~umask, modes
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_adapter_type_must_match_the_model(tmp_path, base_dir, tokenizer):
    model, _ = loaded(base_dir, tokenizer, adapter="none")
    lora_cfg = parse_config(
        {"model": {"preset": "tiny-llama"}, "data": {"datasets": [{"path": "d.jsonl", "type": "completion"}]}}
    ).adapter
    with pytest.raises(HoneError, match="adapter.type is 'lora' but the model is a plain model"):
        save_final(model, tokenizer, tmp_path / "final", lora_cfg)


def test_a_failed_save_leaves_the_previous_final_intact(tmp_path, base_dir, tokenizer, monkeypatch):
    model, adapter = loaded(base_dir, tokenizer, adapter="none")
    final = save_final(model, tokenizer, tmp_path / "final", adapter)
    before = {p.name: p.read_bytes() for p in final.iterdir()}

    def half_written(model, directory):
        (directory / "model.safetensors").write_bytes(b"half a model")
        raise OSError("disk full")

    monkeypatch.setattr(save_module, "write_model", half_written)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_final(model, tokenizer, final, adapter)
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # no temp directory left behind


def test_a_second_save_replaces_the_first_completely(tmp_path, base_dir, tokenizer):
    model, adapter = loaded(base_dir, tokenizer, adapter="none")
    final = save_final(model, tokenizer, tmp_path / "final", adapter)
    (final / "stale.txt").write_text("from an older save")
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    ids = torch.randint(0, len(tokenizer), (1, 6))
    expected = logits(model, ids)
    save_final(model, tokenizer, final, adapter)
    assert "stale.txt" not in files(final)
    assert [p.name for p in tmp_path.iterdir()] == ["final"]
    reloaded = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    torch.testing.assert_close(logits(reloaded, ids), expected, rtol=0, atol=0)


@pytest.mark.parametrize("adapter", [{"lora_modules_to_save": ["lm_head"]}, "none"])
def test_trainable_state_dict_round_trips(base_dir, tokenizer, adapter):
    model, _ = loaded(base_dir, tokenizer, adapter=adapter)
    state = trainable_state_dict(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(state) == trainable
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in state.values())
    if adapter != "none":
        assert all("lora_" in n or "modules_to_save" in n for n in state)
    ids = torch.randint(0, len(tokenizer), (2, 8))
    expected = logits(model, ids)

    other, _ = loaded(base_dir, tokenizer, adapter=adapter)  # same base, other trainable values
    assert not torch.equal(logits(other, ids), expected)
    load_trainable_state_dict(other, state)
    torch.testing.assert_close(logits(other, ids), expected, rtol=0, atol=0)
    assert all(torch.equal(state[n], p.detach()) for n, p in other.named_parameters() if p.requires_grad)


def test_trainable_state_dict_refuses_another_adapter(base_dir, tokenizer):
    lora_model, _ = loaded(base_dir, tokenizer)
    full_model, _ = loaded(base_dir, tokenizer, adapter="none")
    with pytest.raises(HoneError, match="missing from it.*the model does not train"):
        load_trainable_state_dict(lora_model, trainable_state_dict(full_model))
    other_rank, _ = loaded(base_dir, tokenizer, adapter={"lora_r": 4})
    with pytest.raises(HoneError, match=r"has shape \(4, 64\) but the model.s is \(16, 64\) \(another lora_r"):
        load_trainable_state_dict(lora_model, trainable_state_dict(other_rank))


def test_trainable_state_dict_sees_through_torch_compile(tokenizer):
    model = tiny_model("tiny-llama", tokenizer)
    compiled = torch.compile(model)  # wrapping only: nothing is compiled until it runs
    assert trainable_state_dict(compiled).keys() == trainable_state_dict(model).keys()
