"""Shared-prompt preference pairs (``training.preference.share_prompt``): each prompt once, its
chosen and rejected completions as two branches that see the prompt and not each other. The
row's layout, the log-probabilities and whole training runs against the unshared pairs (fp32,
1e-5), and where ``auto`` shares and through which attention."""

import os
import random
from pathlib import Path

import pytest
import torch
from rich.console import Console

from hone import testing
from hone.data.collate import IGNORE_INDEX
from hone.data.pairs import ALIGN, CHOSEN_BRANCH, REJECTED_BRANCH, TRUNK, collate_pairs
from hone.models.attention.layout import AttentionLayout, layout_for
from hone.models.attention.packed_mask import document_dense_mask
from hone.models.attention.setup import FLEX_MIN_HEAD_DIM
from hone.models.attention.varlen import TREE_KEYS, VARLEN_SDPA, reference_varlen_attention, register_varlen_sdpa
from hone.models.structure import causal_lm_parts
from hone.runtime.pair_loss import PairLoss
from hone.runtime.step import forward_hidden
from hone.testing import VOCAB, plan_hooks, tiny_config, tiny_llama, tiny_model, tiny_tokenizer, with_random_lora
from hone.train.loop import train_loop
from hone.transforms.base import RunFacts
from hone.transforms.prompt_sharing import share_prompt_choice, sharing_problems

SEED = int(os.environ.get("HONE_TEST_SEED", random.randrange(10_000)))  # fresh each session; fix it to reproduce


def random_pairs(n: int, seed: int, vocab: int = VOCAB) -> list[dict[str, list[int]]]:
    """``n`` random pairs, the first with a one-token prompt (no shared trunk at all)."""
    pairs = testing.random_pairs(n, seed, vocab, shortest_prompt=1)
    pairs[0]["prompt_ids"] = pairs[0]["prompt_ids"][:1]
    return pairs


@pytest.mark.parametrize("prompt_nll", [False, True])
def test_a_shared_row_holds_each_prompt_once_and_the_same_targets_as_the_unshared_row(prompt_nll):
    pairs = random_pairs(4, SEED)
    shared = collate_pairs(pairs, pad_id=0, prompt_nll=prompt_nll, share_prompt=True)
    plain = collate_pairs(pairs, pad_id=0, prompt_nll=prompt_nll)
    P = len(pairs)
    tokens = sum(len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) + 1 for p in pairs)
    width = shared.input_ids.shape[1]
    assert shared.tokens == tokens < plain.tokens + P and width % ALIGN == 0 and tokens <= width < tokens + ALIGN
    # every sequence's targets, in order, and every count the objective divides by, as unshared
    for slot in range(3 * P):
        assert shared.targets[shared.segments == slot].tolist() == plain.targets[plain.segments == slot].tolist()
    assert torch.equal(shared.completion_tokens, plain.completion_tokens)
    assert (shared.nll_tokens, shared.trained_tokens, shared.pairs) == (plain.nll_tokens, plain.trained_tokens, plain.pairs)
    assert ((shared.segments >= 0) == (shared.targets != IGNORE_INDEX)).all()
    assert shared.counted.tolist() == torch.nonzero(shared.segments[0] >= 0).squeeze(1).tolist()
    # the layout: trunk (positions from 0), then each branch from the prompt's last position
    ids, positions, branches = shared.input_ids[0].tolist(), shared.position_ids[0].tolist(), shared.branches[0].tolist()
    at = 0
    for pair in pairs:
        prompt = pair["prompt_ids"]
        trunk = len(prompt) - 1
        assert ids[at : at + trunk] == prompt[:-1] and positions[at : at + trunk] == list(range(trunk))
        assert branches[at : at + trunk] == [TRUNK] * trunk
        at += trunk
        for key, branch in (("chosen_ids", CHOSEN_BRANCH), ("rejected_ids", REJECTED_BRANCH)):
            n = len(pair[key]) + 1
            assert ids[at : at + n] == prompt[-1:] + pair[key]
            assert positions[at : at + n] == list(range(trunk, trunk + n)) and branches[at : at + n] == [branch] * n
            at += n
    assert branches[at:] == [TRUNK] * (width - at) and (width == at or positions[at] == 0)  # padding: a document of its own


def test_the_tree_mask_lets_a_branch_see_the_trunk_and_itself_only():
    pairs = [
        {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10]},
        {"prompt_ids": [11, 12], "chosen_ids": [13], "rejected_ids": [14]},
    ]
    batch = collate_pairs(pairs, pad_id=0, share_prompt=True)
    mask = document_dense_mask(batch.position_ids, batch.branches)[0, 0]
    # pair 0: trunk 0-1, chosen 2-4, rejected 5-6; pair 1: trunk 7, chosen 8-9, rejected 10-11
    sees = {q: torch.nonzero(mask[q]).squeeze(1).tolist() for q in range(12)}
    assert sees[1] == [0, 1] and sees[4] == [0, 1, 2, 3, 4] and sees[6] == [0, 1, 5, 6]
    assert sees[7] == [7] and sees[9] == [7, 8, 9] and sees[11] == [7, 10, 11]
    assert torch.equal(
        document_dense_mask(batch.position_ids, None), document_dense_mask(batch.position_ids, torch.zeros_like(batch.branches))
    )


def test_the_varlen_tree_gives_each_branch_the_trunk_and_itself_as_the_mask_does():
    """The rejected branch as a segment whose keys are the trunk's gathered again, under the
    kernel's bottom-right causal alignment, against sdpa with the dense tree mask (fp32)."""
    batch = collate_pairs(random_pairs(4, SEED + 5), pad_id=0, share_prompt=True)
    tree, width = batch.tree, batch.input_ids.shape[1]
    assert tree.queries[-1] == width and tree.keys[-1] == len(tree.key_index)
    gen = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(width, heads, 8, generator=gen) for heads in (4, 2, 2))  # grouped key/value heads
    out = reference_varlen_attention(q, k[tree.key_index], v[tree.key_index], tree.queries, 0.3, tree.keys)
    mask = document_dense_mask(batch.position_ids, batch.branches)[0]  # [1, T, T]
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=mask,
        scale=0.3,
    ).transpose(0, 1)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def _logps(model, pairs, objective: str, share: bool, layout: AttentionLayout) -> torch.Tensor:
    batch = collate_pairs(pairs, pad_id=0, prompt_nll=objective == "orpo", share_prompt=share).with_attention(layout)
    decoder, head = causal_lm_parts(model)
    with torch.no_grad():
        return PairLoss(objective, beta=0.1).logps(forward_hidden(decoder, batch), head, batch)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_shared_log_probs_equal_the_unshared_ones(preset, objective):
    model = tiny_model(preset, tiny_tokenizer(), seed=SEED)
    model.config._attn_implementation = "sdpa"
    pairs = random_pairs(3, SEED + 1, vocab=model.config.vocab_size)
    plain = _logps(model, pairs, objective, False, layout_for(model))
    shared = _logps(model, pairs, objective, True, layout_for(model, shares_prompt=True))
    assert plain.shape == shared.shape == (3 * len(pairs) if objective == "orpo" else 2 * len(pairs),)
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_hone_s_varlen_backend_reads_the_tree_boundaries(objective):
    """Through the model: transformers hands the tree's boundaries and key order to hone's varlen
    backend (its reference on the CPU), whose log-probs are the unshared pairs'."""
    model = tiny_model("tiny-qwen3", tiny_tokenizer(), seed=SEED)
    pairs = random_pairs(3, SEED + 6, vocab=model.config.vocab_size)
    model.config._attn_implementation = "sdpa"
    plain = _logps(model, pairs, objective, False, layout_for(model))
    model.set_attn_implementation(register_varlen_sdpa())
    tree = layout_for(model, shares_prompt=True)
    assert tree.kind == "tree_boundaries" and layout_for(model).kind == "boundaries"
    torch.testing.assert_close(_logps(model, pairs, objective, True, tree), plain, rtol=1e-5, atol=1e-5)


def test_flex_attention_reads_the_tree_as_a_block_mask():
    """flex attention has no backward on the CPU: its forward, against sdpa's dense tree mask."""
    model = tiny_llama(SEED)
    pairs = random_pairs(3, SEED + 2)
    model.config._attn_implementation = "sdpa"
    dense = _logps(model, pairs, "dpo", True, layout_for(model, shares_prompt=True))
    model.set_attn_implementation("flex_attention")
    flex_layout = layout_for(model, shares_prompt=True)
    assert flex_layout.kind == "block_mask"
    torch.testing.assert_close(_logps(model, pairs, "dpo", True, flex_layout), dense, rtol=1e-5, atol=1e-5)


def test_a_layout_of_document_boundaries_refuses_branches():
    with pytest.raises(ValueError, match="shared-prompt"):
        AttentionLayout("boundaries", shares_prompt=True)
    batch = collate_pairs(random_pairs(2, SEED), pad_id=0, share_prompt=True)
    with pytest.raises(ValueError, match="branches"):
        AttentionLayout("boundaries").packed_inputs(batch.position_ids, batch.boundaries(), batch.branches)
    assert TREE_KEYS in AttentionLayout("tree_boundaries", True).packed_inputs(
        batch.position_ids, batch.boundaries(), batch.branches
    )
    plain_boundaries = {k: v for k, v in batch.boundaries().items() if k != TREE_KEYS}
    with pytest.raises(ValueError, match="tree boundaries"):
        AttentionLayout("tree_boundaries", True).packed_inputs(batch.position_ids, plain_boundaries, batch.branches)


def _run(
    tmp_path: Path, objective: str, share: bool, adapter: bool, pairs, attention: str = "sdpa"
) -> tuple[list[dict], dict[str, torch.Tensor]]:
    cfg = tiny_config(
        tmp_path / f"{objective}-{share}-{adapter}-{attention}",
        adapter={"type": "lora", "lora_r": 4} if adapter else {"type": "none"},
        training={
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "max_steps": 2,
            "objective": objective,
            "preference": {"beta": 0.5, "share_prompt": share},
        },
        optimizer={"learning_rate": 1e-2, "weight_decay": 0.01, "adam_epsilon": 1e-3},  # see test_preference_train
    )
    torch.manual_seed(SEED)
    model = tiny_llama(SEED, freeze_embeddings=adapter)
    model = with_random_lora(model, SEED + 2) if adapter else model
    model.config._attn_implementation = attention
    hooks = plan_hooks(model, cfg)
    assert hooks.layout.shares_prompt is share
    train_loop(model, pairs, None, cfg, device=torch.device("cpu"), pad_id=0, console=Console(quiet=True), hooks=hooks)
    from hone.track.metrics import read_metrics

    rows = [r for r in read_metrics(cfg.training.output_dir / "metrics.jsonl") if "loss" in r]
    return rows, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "objective,adapter,attention",
    [
        ("dpo", True, "sdpa"),
        ("dpo", True, VARLEN_SDPA),  # the tree boundaries, through the varlen backend's reference
        ("ipo", True, "sdpa"),
        ("orpo", True, "sdpa"),
        ("orpo", False, "sdpa"),
        pytest.param("dpo", False, "sdpa", marks=pytest.mark.slow),
    ],
)
def test_training_on_shared_prompts_gives_the_losses_and_weights_of_the_unshared_pairs(tmp_path, objective, adapter, attention):
    register_varlen_sdpa()
    pairs = random_pairs(8, SEED + 3)
    plain_rows, plain_weights = _run(tmp_path, objective, False, adapter, pairs, attention)
    rows, weights = _run(tmp_path, objective, True, adapter, pairs, attention)
    names = ["loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"]
    for a, b in zip(plain_rows, rows, strict=True):
        reward_abs = 1e-5 * 0.5 * max(abs(a["logps/chosen"]), abs(a["logps/rejected"]))  # as test_preference_train
        for name in names:
            assert b[name] == pytest.approx(a[name], rel=1e-5, abs=reward_abs if name == "rewards/margins" else 1e-6), name
    assert plain_weights.keys() == weights.keys()
    for name, weight in plain_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=1e-5, atol=1e-5)


def _cfg(**sections):
    raw = {"training": {"objective": "dpo"}, **{k: v for k, v in sections.items() if k != "training"}}
    raw["training"] = {**raw["training"], **sections.get("training", {})}
    return tiny_config(Path("unused"), **raw)


CPU, GPU = RunFacts(torch.device("cpu")), RunFacts(torch.device("cuda"))


def test_auto_shares_through_flex_on_a_compiling_gpu_and_sdpa_s_mask_elsewhere():
    cfg = _cfg(model={"attn_implementation": "sdpa"})
    assert share_prompt_choice(cfg, GPU, compiles=True)[:2] == (True, "flex")
    assert share_prompt_choice(cfg, GPU, compiles=False)[:2] == (True, "mask")  # uncompiled flex materialises the scores
    assert share_prompt_choice(cfg, CPU, compiles=False)[:2] == (True, "mask")
    assert share_prompt_choice(_cfg(model={"attn_implementation": "flex_attention"}), CPU, compiles=False)[:2] == (True, "flex")
    off, kernel, why = share_prompt_choice(_cfg(training={"preference": {"share_prompt": False}}), GPU, compiles=True)
    assert (off, kernel) == (False, None) and "share_prompt: false" in why
    assert share_prompt_choice(tiny_config(Path("unused")), GPU, compiles=True)[:2] == (False, None)  # sft: no pairs


def test_auto_shares_through_the_varlen_kernel_where_it_runs():
    """bf16 on a GPU: torch's varlen kernel with the tree boundaries, compiled or not; float32
    (which the kernel does not take) keeps flex attention; ``sdpa_varlen: true`` asks for it."""
    bf16 = _cfg(model={"attn_implementation": "sdpa", "dtype": "bfloat16"})
    for compiles in (True, False):
        shares, kernel, why = share_prompt_choice(bf16, GPU, compiles=compiles)
        assert (shares, kernel) == (True, "varlen") and "varlen kernel" in why
    assert share_prompt_choice(bf16, CPU, compiles=False)[:2] == (True, "mask")
    assert share_prompt_choice(_cfg(model={"attn_implementation": "sdpa"}), GPU, compiles=True)[:2] == (True, "flex")
    assert share_prompt_choice(_cfg(model={"sdpa_varlen": True, "dtype": "bfloat16"}), GPU, compiles=False)[:2] == (
        True,
        "varlen",
    )
    gemma = _cfg(model={"preset": "tiny-gemma", "dtype": "bfloat16", "attn_implementation": "sdpa"})
    assert share_prompt_choice(gemma, GPU, compiles=True)[:2] == (False, None)  # sliding windows: no tree at all


def test_sdpa_varlen_false_keeps_sdpa_s_tree_mask_on_a_compiling_gpu():
    shares, kernel, why = share_prompt_choice(
        _cfg(model={"attn_implementation": "sdpa", "sdpa_varlen": False}), GPU, compiles=True
    )
    assert (shares, kernel) == (True, "mask") and "model.sdpa_varlen: false" in why


def test_heads_too_narrow_for_compiled_flex_keep_sdpa_s_mask_on_the_gpu():
    narrow = _cfg(model={"attn_implementation": "sdpa", "preset_overrides": {"head_dim": FLEX_MIN_HEAD_DIM // 2}})
    shares, kernel, why = share_prompt_choice(narrow, GPU, compiles=True)
    assert (shares, kernel) == (True, "mask") and f"heads of {FLEX_MIN_HEAD_DIM // 2}" in why
    wide = _cfg(model={"attn_implementation": "sdpa", "preset_overrides": {"head_dim": FLEX_MIN_HEAD_DIM}})
    assert share_prompt_choice(wide, GPU, compiles=True)[:2] == (True, "flex")


@pytest.mark.parametrize(
    "model,blocker",
    [
        ({"attn_implementation": "eager"}, "model.attn_implementation: eager"),
        ({"preset": "tiny-gemma"}, "sliding-window layers"),
    ],
)
def test_auto_leaves_the_prompt_in_both_sequences_where_the_mask_cannot_run_and_true_stops(model, blocker):
    auto = _cfg(model=model)
    shares, kernel, why = share_prompt_choice(auto, GPU, compiles=True)
    assert (shares, kernel) == (False, None) and blocker in why
    assert sharing_problems(auto) == []
    problems = sharing_problems(_cfg(model=model, training={"preference": {"share_prompt": True}}))
    assert len(problems) == 1 and "training.preference.share_prompt: true" in problems[0] and blocker in problems[0]
