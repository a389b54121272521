"""The TRL DPO peer script (benchmarks/peer/trl_dpo.py): its defaults are the issue's workload
(a pair of 512 + 2 x 768 = 2048 tokens, one pair a micro-batch, LoRA r16), and the synthetic
pairs tokenize, through the word-level tokenizer TRL is given, to exactly the lengths asked for.
The training itself runs on a GPU (and as a CPU smoke test by hand: see the script's header)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peer" / "trl_dpo.py"


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("trl_dpo_peer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_are_the_issue_workload(peer):
    a = peer.parse_args([])
    assert (a.arch, a.mbs, a.rank, a.gc, a.compile, a.loss, a.beta) == ("qwen3-8b", 1, 16, 1, 0, "sigmoid", 0.1)
    assert a.prompt_len + 2 * a.completion_len == 2048
    assert a.targets.split(",") == ["q_proj", "k_proj", "v_proj", "o_proj"]
    with pytest.raises(SystemExit):
        peer.parse_args(["--completion-len", "1"])


def test_pairs_tokenize_to_exactly_the_asked_lengths(peer):
    pairs = peer.synth_pairs(3, prompt_len=7, completion_len=5, vocab_size=50, seed=1)
    assert pairs == peer.synth_pairs(3, prompt_len=7, completion_len=5, vocab_size=50, seed=1)  # seeded
    tokenizer = peer.word_tokenizer(50)
    for pair in pairs:
        assert pair["chosen"] != pair["rejected"]
        assert all(peer.FIRST_WORD <= i < 50 for ids in pair.values() for i in ids)
        text = peer.as_text(pair)
        prompt = tokenizer(text["prompt"])["input_ids"]
        chosen = tokenizer(text["prompt"] + text["chosen"] + tokenizer.eos_token)["input_ids"]  # as TRL builds it
        assert prompt == pair["prompt"] and len(prompt) == 7
        assert chosen == pair["prompt"] + pair["chosen"] + [peer.EOS] and len(chosen) == 7 + 5
