"""The memory decisions of a preference run see its rows as wide as the data's pairs make them
(``hone.transforms.prompt_sharing.pair_rows_config``), not two full ``sequence_len`` sequences
a pair: measured against the H200 peaks of qwen3-8b DPO (benchmarks/2026-11-29-h200-dpo-graphs.md)."""

import pytest
import torch

from hone.config import parse_config
from hone.data.stats import SplitStats
from hone.transforms.base import RunFacts
from hone.transforms.decide import decide
from hone.transforms.memory.estimate import estimate_memory
from hone.transforms.memory.knobs import Knobs
from hone.transforms.prompt_sharing import pair_rows_config
from hone.units import GIB

QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _cfg(objective="dpo", sequence_len=1280, pairs=1):
    data = {"datasets": [{"path": "p.jsonl", "type": "preference" if objective != "sft" else "pretokenized"}]}
    return parse_config(
        {
            "model": {"preset": "qwen3-8b", "dtype": "bfloat16"},
            "data": {**data, "sequence_len": sequence_len},
            "adapter": {"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": QKVO},
            "training": {"objective": objective, "micro_batch_size": pairs},
        }
    )


def _stats(prompt=512, completion=768) -> SplitStats:
    return SplitStats(
        rows=64, tokens=0, trained_tokens=0, min_length=prompt + completion, max_length=prompt + completion, histogram=[],
        pairs=True, max_prompt=prompt, max_chosen=completion, max_rejected=completion, max_pair_tokens=prompt + 2 * completion,
    )  # fmt: skip


def _facts(memory_gib=139.8, *splits):
    return RunFacts(torch.device("cuda"), memory_bytes=int(memory_gib * GIB), pair_splits=splits)


def test_pair_rows_are_as_wide_as_the_data_makes_them_and_never_wider_than_written():
    cfg = _cfg()
    assert pair_rows_config(cfg, _facts(), True) is cfg  # no statistics (hone plan): as written
    assert pair_rows_config(_cfg("sft"), _facts(139.8, _stats()), True).data.sequence_len == 1280
    shared = pair_rows_config(cfg, _facts(139.8, _stats()), True)
    assert shared.data.sequence_len == 1032  # 2,049 tokens -> a row of 2,064, two sequences of 1,032
    unshared = pair_rows_config(cfg, _facts(139.8, _stats()), False)
    assert unshared.data.sequence_len == 1280  # 2 x 1,280 = 2,560 already: nothing to take off
    two = pair_rows_config(_cfg(pairs=2), _facts(139.8, _stats(prompt=100, completion=200)), True)
    assert two.data.sequence_len == 252  # 2 pairs x 501 tokens -> a row of 1,008: 4 sequences of 252
    assert cfg.data.sequence_len == 1280  # the user's config is not touched


@pytest.mark.parametrize(("policy", "budget", "measured"), [("none", None, 23.66), ("selective", 0.8, 21.76)])
def test_the_estimate_of_a_dpo_step_from_its_data_is_within_five_percent_of_the_h200(policy, budget, measured):
    """Without the data's statistics the estimate counted 2 x 1,280 tokens a pair: 25.8 and 24.0
    GiB, 9-10% above these peaks (the prompt is computed once)."""
    cfg = pair_rows_config(_cfg(), _facts(139.8, _stats()), True)
    total = estimate_memory(cfg, Knobs(policy, "fused_linear_ce", compiled=True, selective_budget=budget)).total / GIB
    assert total == pytest.approx(measured, rel=0.05)


def test_auto_checkpointing_keeps_every_activation_where_the_pairs_fit():
    """A card of 27.5 GiB (24.75 with the margin): two full sequences a pair do not fit without
    checkpointing (25.0 GiB), the data's rows do (23.3)."""
    assert decide(_cfg(), _facts(27.5)).checkpointing != "none"
    assert decide(_cfg(), _facts(27.5, _stats())).checkpointing == "none"


def test_the_bench_estimates_its_pairs_as_the_run_decides_them():
    """``hone bench``'s estimated column for the DPO spec: the pairs it writes have exact lengths,
    so its statistics are known before the run; the estimate is the run's (23.3 GiB), not two
    full sequences a pair (25.0; both counted with hone's fused LoRA layer, the measured peak's
    23.66 with PEFT's)."""
    from pathlib import Path

    from hone.bench.pairs import pair_stats
    from hone.bench.spec import load_spec
    from hone.bench.worker import _hone_config
    from hone.transforms.decide import decided_estimate

    spec = load_spec(Path(__file__).resolve().parents[2] / "benchmarks" / "specs" / "qwen3-8b-dpo.yml", only=["4"])
    cfg = _hone_config(spec, spec.conditions[0], Path("scratch"), Path("pairs.jsonl"))
    memory = int(139.8 * GIB)
    stats = (pair_stats(spec.workload, 64),)
    assert stats[0].max_pair_tokens == 2048 and stats[0].max_prompt == 512
    with_stats = decided_estimate(cfg, "cuda", host_budget=64 * GIB, memory_bytes=memory, pair_splits=stats).total / GIB
    without = decided_estimate(cfg, "cuda", host_budget=64 * GIB, memory_bytes=memory).total / GIB
    assert with_stats == pytest.approx(23.66, rel=0.05) and without == pytest.approx(25.0, abs=0.1)


def test_a_pair_objective_counts_the_per_sequence_log_probs_chunk_of_its_head():
    """The per-sequence log-probs take half the fused cross-entropy's chunk under a frozen head
    (hone.kernels.sequence_logprobs): the estimate counts the chunk the kernel takes (qwen3: 384
    tokens under LoRA, 768 with a trained head; SFT's cross-entropy 768), nothing else changes."""
    from hone.kernels.sequence_logprobs import default_sequence_chunk_tokens
    from hone.transforms.memory.terms.loss import fused_chunk_tokens

    tokens, vocab = 2 * 1280, 151_936
    assert fused_chunk_tokens(tokens, vocab, sequences=True, head_trained=False) == 384
    assert fused_chunk_tokens(tokens, vocab, sequences=True, head_trained=True) == 768 == fused_chunk_tokens(tokens, vocab)
    for trained in (False, True):
        assert fused_chunk_tokens(tokens, vocab, True, trained) == default_sequence_chunk_tokens(tokens, vocab, trained)
    knobs = Knobs("none", "fused_linear_ce")
    dpo, sft = estimate_memory(_cfg("dpo"), knobs), estimate_memory(_cfg("sft", sequence_len=2 * 1280), knobs)
    assert sft.loss - dpo.loss == (768 - 384) * vocab * 2  # one chunk of bf16 logits, half as long
