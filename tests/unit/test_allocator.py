"""memory.expandable_segments: when a run asks torch's CUDA allocator for expandable segments,
and that a user's own allocator setting is never overwritten."""

import os

import pytest

from hone.config.errors import ConfigError
from hone.config.loader import parse_config
from hone.transforms.allocator import ALLOC_ENV, LONG_CONTEXT_TOKENS, SETTING, allocator_choice, configure_allocator


def _cfg(seq: int = 2048, mbs: int = 1, **memory):
    raw = {
        "model": {"preset": "tiny-llama"},
        "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}], "sequence_len": seq},
        "training": {"micro_batch_size": mbs},
        "memory": memory,
    }
    return parse_config(raw)


@pytest.fixture
def clean_env(monkeypatch):
    for name in ALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_auto_turns_on_from_the_long_context_threshold(clean_env):
    assert not allocator_choice(_cfg(seq=LONG_CONTEXT_TOKENS // 2), "cuda").expandable
    on = allocator_choice(_cfg(seq=LONG_CONTEXT_TOKENS // 2, mbs=2), "cuda")  # tokens per micro-batch count
    assert on.expandable and "32,768 tokens" in on.why


def test_explicit_values_and_cpu(clean_env):
    assert allocator_choice(_cfg(seq=128, expandable_segments=True), "cuda").expandable
    assert not allocator_choice(_cfg(seq=65536, expandable_segments=False), "cuda").expandable
    cpu = allocator_choice(_cfg(seq=65536, expandable_segments=True), "cpu")
    assert not cpu.expandable and "only CUDA" in cpu.why


def test_the_users_environment_wins(clean_env):
    clean_env.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    choice = configure_allocator(_cfg(seq=65536, expandable_segments=True), "cuda")
    assert not choice.expandable and "leaves it as it is" in choice.why
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_configure_sets_the_environment_before_cuda_starts(clean_env):
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA already initialised in this process")
    try:
        choice = configure_allocator(_cfg(seq=65536), "cuda")
        assert choice.expandable and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == SETTING
        again = configure_allocator(_cfg(seq=65536), "cuda")  # hone's own setting is not the user's
        assert again == choice and again.user_setting is None
    finally:  # set by hone, not through monkeypatch: taken out here
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    assert not configure_allocator(_cfg(seq=1024), "cuda").expandable
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


@pytest.mark.parametrize("value", ["sometimes", 3, "2"])
def test_bad_values_are_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match="memory.expandable_segments"):
        _cfg(expandable_segments=value)
