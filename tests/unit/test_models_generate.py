"""Generation and merging from a run directory (config.yml + final/), built here by hand."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hone.config import parse_config
from hone.config.loader import dump_config
from hone.data.formats import ALPACA_PROMPT
from hone.errors import HoneError
from hone.export.generate import PromptSetup, format_prompt, generate, load_for_inference
from hone.export.merge import merge_adapter
from hone.models.loader import load_model
from hone.models.save import save_final
from hone.testing import greedy_by_hand, save_tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def make_run(run_dir: Path, tokenizer, model: dict, adapter="lora", data_type="completion", dtype="float32"):
    """What ``hone train`` leaves: the resolved config and final/, with moved trainable weights."""
    cfg = parse_config(
        {
            "model": {"dtype": dtype, **model},
            "data": {"datasets": [{"path": "d.jsonl", "type": data_type}]},
            "adapter": adapter,
            "training": {"output_dir": str(run_dir), "seed": 21},
        }
    )
    trained = load_model(cfg, tokenizer, "cpu").model
    with torch.no_grad():
        for param in trained.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yml").write_text(dump_config(cfg))
    save_final(trained, tokenizer, run_dir / "final", cfg.adapter)
    return trained.eval()


@pytest.fixture(scope="module")
def preset_lora_run(tmp_path_factory, tokenizer):
    run = tmp_path_factory.mktemp("runs") / "lora"
    trained = make_run(run, tokenizer, {"preset": "tiny-llama"}, adapter={"lora_modules_to_save": ["lm_head"]})
    return run, trained


def test_preset_lora_run_reloads_with_identical_logits(preset_lora_run, tokenizer):
    run, trained = preset_lora_run
    model, loaded_tokenizer = load_for_inference(run, "cpu")
    assert not model.training
    ids = torch.randint(0, len(tokenizer), (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=0, atol=0)
    assert loaded_tokenizer.encode("a green lime") == tokenizer.encode("a green lime")


def test_greedy_generate_matches_argmax_decoding(preset_lora_run, tokenizer):
    run, trained = preset_lora_run
    model, tok = load_for_inference(run, "cpu")
    prompt = "The quick brown fox"
    text = generate(model, tok, prompt, max_new_tokens=12, temperature=0.0)
    assert text == greedy_by_hand(trained, tokenizer, prompt, 12)
    assert text == generate(model, tok, prompt, max_new_tokens=12, temperature=0.0)


def test_sampling_is_reproducible_by_seed(preset_lora_run):
    run, _ = preset_lora_run
    model, tok = load_for_inference(run, "cpu")
    kwargs = dict(max_new_tokens=16, temperature=1.5, top_p=1.0)
    first = generate(model, tok, "hello", seed=3, **kwargs)
    assert first == generate(model, tok, "hello", seed=3, **kwargs)
    assert first != generate(model, tok, "hello", seed=4, **kwargs)


def test_generate_restores_train_mode(preset_lora_run):
    run, _ = preset_lora_run
    model, tok = load_for_inference(run, "cpu")
    model.train()
    generate(model, tok, "hello", max_new_tokens=2)
    assert model.training


def test_path_base_lora_run(tmp_path, tokenizer):
    base = save_tiny_model(tmp_path / "base", "tiny-qwen3-moe", tokenizer, seed=5)
    trained = make_run(tmp_path / "run", tokenizer, {"path": str(base)})
    model, tok = load_for_inference(tmp_path / "run", "cpu")
    assert type(model.get_base_model()).__name__ == "Qwen3MoeForCausalLM"
    assert generate(model, tok, "a lemon", max_new_tokens=6) == greedy_by_hand(trained, tokenizer, "a lemon", 6)


def test_full_finetune_run(tmp_path, tokenizer):
    trained = make_run(tmp_path / "run", tokenizer, {"preset": "tiny-gemma"}, adapter="none")
    model, tok = load_for_inference(tmp_path / "run", "cpu")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert generate(model, tok, "why", max_new_tokens=6) == greedy_by_hand(trained, tokenizer, "why", 6)


def test_prompts_are_wrapped_as_the_run_was_trained(tmp_path, tokenizer):
    trained = make_run(tmp_path / "chat", tokenizer, {"preset": "tiny-qwen3"}, data_type="chat")
    model, tok = load_for_inference(tmp_path / "chat", "cpu")
    wrapped = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert format_prompt(tok, "hi", PromptSetup("chat")) == (wrapped, False)
    expected = greedy_by_hand(trained, tokenizer, wrapped, 5, add_special_tokens=False)
    assert generate(model, tok, "hi", max_new_tokens=5) == expected  # chat=None: as trained
    assert generate(model, tok, "hi", max_new_tokens=5, chat=True) == expected
    assert generate(model, tok, "hi", max_new_tokens=5, chat=False) == greedy_by_hand(trained, tokenizer, "hi", 5)

    assert format_prompt(tok, "add 2 and 2", PromptSetup("alpaca")) == (ALPACA_PROMPT.format(instruction="add 2 and 2"), True)
    assert format_prompt(tok, "plain", PromptSetup("raw")) == ("plain", True)


def test_chat_without_a_template_is_a_clear_error(tokenizer):
    bare = tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(HoneError, match="chat template"):
        format_prompt(bare, "hi", PromptSetup("chat"))


def test_generate_refuses_bad_settings(preset_lora_run):
    run, _ = preset_lora_run
    model, tok = load_for_inference(run, "cpu")
    with pytest.raises(HoneError, match="temperature: -1"):
        generate(model, tok, "x", temperature=-1)
    with pytest.raises(HoneError, match=r"top_p: 0 must be in \(0, 1\]"):
        generate(model, tok, "x", top_p=0)
    with pytest.raises(HoneError, match="max_new_tokens: 0"):
        generate(model, tok, "x", max_new_tokens=0)


def test_bad_run_directories(tmp_path):
    with pytest.raises(HoneError, match="does not exist"):
        load_for_inference(tmp_path / "nope", "cpu")
    with pytest.raises(HoneError, match="no config.yml"):
        load_for_inference(tmp_path, "cpu")
    (tmp_path / "config.yml").write_text("model: {preset: tiny-llama}\ndata: {datasets: [{path: d.jsonl, type: completion}]}\n")
    with pytest.raises(HoneError, match="no final/ directory: the run has not finished"):
        load_for_inference(tmp_path, "cpu")
    (tmp_path / "final").mkdir()
    with pytest.raises(HoneError, match="neither a PEFT adapter"):
        load_for_inference(tmp_path, "cpu")


def test_merge_gives_a_plain_model_with_the_same_logits(preset_lora_run, tmp_path, tokenizer):
    run, trained = preset_lora_run
    out = merge_adapter(run, tmp_path / "merged")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, len(tokenizer), (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]


def test_merge_saves_in_the_run_dtype(tmp_path, tokenizer):
    make_run(tmp_path / "run", tokenizer, {"preset": "tiny-llama"}, dtype="bfloat16")
    out = merge_adapter(tmp_path / "run", tmp_path / "merged")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_merge_refuses_full_runs_and_overwriting_the_run(tmp_path, preset_lora_run, tokenizer):
    make_run(tmp_path / "full", tokenizer, {"preset": "tiny-llama"}, adapter="none")
    with pytest.raises(HoneError, match="full fine-tune.*no adapter to merge"):
        merge_adapter(tmp_path / "full", tmp_path / "merged")
    run, _ = preset_lora_run
    with pytest.raises(HoneError, match="would overwrite the run"):
        merge_adapter(run, run / "final")
