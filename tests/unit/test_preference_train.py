"""Preference pairs through the training path: packing a micro-batch of pairs, each sequence's
log-probability equal to the sequence run alone, and the window's normalisation over pairs
(DPO) and over pairs and NLL tokens (ORPO) exact under any ``micro_batch x accumulation`` split."""

import os
import random

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from hone.data.collate import IGNORE_INDEX
from hone.data.pairs import ALIGN, collate_pairs
from hone.models.attention.layout import layout_for
from hone.models.structure import causal_lm_parts
from hone.runtime.pair_loss import PairLoss
from hone.runtime.step import forward_hidden
from hone.testing import plan_hooks, random_pairs, tiny_config, tiny_llama, with_random_lora
from hone.train.loop import train_loop

SEED = int(os.environ.get("HONE_TEST_SEED", random.randrange(10_000)))  # fresh each session; fix it to reproduce


@pytest.mark.parametrize("prompt_nll", [False, True])
def test_a_micro_batch_of_pairs_is_one_packed_row_with_a_segment_per_sequence(prompt_nll):
    pairs = random_pairs(3, SEED)
    batch = collate_pairs(pairs, pad_id=0, prompt_nll=prompt_nll)
    P = len(pairs)
    lengths = [len(p["prompt_ids"]) + len(p[k]) for p in pairs for k in ("chosen_ids", "rejected_ids")]
    width = batch.input_ids.shape[1]
    assert batch.input_ids.shape[0] == 1 and width % ALIGN == 0 and sum(lengths) <= width < sum(lengths) + ALIGN
    assert batch.pairs == P and batch.tokens == sum(lengths)
    assert batch.cu_seqlens.tolist()[: 2 * P + 1] == [sum(lengths[:i]) for i in range(2 * P + 1)]
    segments, targets = batch.segments[0], batch.targets[0]
    assert ((segments >= 0) == (targets != IGNORE_INDEX)).all()  # a target belongs to exactly one sequence
    assert batch.counted.tolist() == [i for i, s in enumerate(segments.tolist()) if s >= 0]  # what the head sees
    for p, pair in enumerate(pairs):
        for slot, key in ((p, "chosen_ids"), (P + p, "rejected_ids")):
            assert targets[segments == slot].tolist() == pair[key]  # the completion, in order, nothing else
            assert batch.completion_tokens[slot] == len(pair[key])
        prompt = targets[segments == 2 * P + p].tolist()
        assert prompt == (pair["prompt_ids"][1:] if prompt_nll else [])  # ORPO: the chosen prompt's predicted tokens
    nll = sum(len(p["chosen_ids"]) + (len(p["prompt_ids"]) - 1 if prompt_nll else 0) for p in pairs)
    assert batch.nll_tokens == nll and batch.trained_tokens == int((targets != IGNORE_INDEX).sum())


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_each_sequence_log_prob_of_the_packed_row_equals_the_sequence_run_alone(objective):
    model = tiny_llama(SEED)
    model.config._attn_implementation = "sdpa"
    pairs = random_pairs(3, SEED + 1)
    loss = PairLoss(objective, beta=0.1)
    batch = collate_pairs(pairs, pad_id=0, prompt_nll=objective == "orpo").with_attention(layout_for(model))
    decoder, head = causal_lm_parts(model)
    with torch.no_grad():
        packed = loss.logps(forward_hidden(decoder, batch), head, batch)
        P = len(pairs)
        for p, pair in enumerate(pairs):
            for slot, key in ((p, "chosen_ids"), (P + p, "rejected_ids")):
                ids = pair["prompt_ids"] + pair[key]
                logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
                logp = F.log_softmax(logits, -1)
                start = len(pair["prompt_ids"])
                alone = sum(logp[t - 1, ids[t]].item() for t in range(start, len(ids)))
                assert packed[slot].item() == pytest.approx(alone, abs=1e-5, rel=1e-5)
                if objective == "orpo" and key == "chosen_ids":
                    prompt = sum(logp[t - 1, ids[t]].item() for t in range(1, start))
                    assert packed[2 * P + p].item() == pytest.approx(prompt, abs=1e-5, rel=1e-5)


def _lora_model():
    torch.manual_seed(SEED)  # PEFT draws the A factors from the global generator
    model = with_random_lora(tiny_llama(SEED), SEED + 2)
    model.config._attn_implementation = "sdpa"
    return model


def _run(tmp_path, objective: str, mbs: int, accum: int, pairs) -> tuple[list[dict], dict[str, torch.Tensor]]:
    cfg = tiny_config(
        tmp_path / f"{objective}-{mbs}x{accum}",
        adapter={"type": "lora", "lora_r": 4},
        training={
            "micro_batch_size": mbs,
            "gradient_accumulation_steps": accum,
            "max_steps": 2,
            "objective": objective,
            "preference": {"beta": 0.5},
        },
        # epsilon well above the gradients' rounding: LoRA's A gets no gradient while B is zero and a
        # tiny one after, where Adam's g / (|g| + eps) turns a 1e-7 rounding difference of the
        # summed micro-batches into a 1% difference of the step (seen in CI: 1.2e-4 after 2 steps)
        optimizer={"learning_rate": 1e-2, "weight_decay": 0.01, "adam_epsilon": 1e-3},
    )
    model = _lora_model()
    train_loop(
        model, pairs, None, cfg, device=torch.device("cpu"), pad_id=0, console=Console(quiet=True), hooks=plan_hooks(model, cfg)
    )
    from hone.track.metrics import read_metrics

    rows = [r for r in read_metrics(cfg.training.output_dir / "metrics.jsonl") if "loss" in r]
    return rows, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_two_pairs_in_one_micro_batch_train_as_two_micro_batches_of_one(tmp_path, objective):
    pairs = random_pairs(8, SEED + 3)
    rows_2x1, weights_2x1 = _run(tmp_path, objective, 2, 1, pairs)
    rows_1x2, weights_1x2 = _run(tmp_path, objective, 1, 2, pairs)
    names = ["loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"]
    names += ["nll_loss", "log_odds_ratio"] if objective == "orpo" else []
    for a, b in zip(rows_2x1, rows_1x2, strict=True):
        # rewards are beta x differences of log-probs: their rounding scales with the log-probs, not
        # with the (small, cancelling) difference (a random seed moved a margin of 0.0243 by 1.4e-6)
        reward_abs = 1e-5 * 0.5 * max(abs(a["logps/chosen"]), abs(a["logps/rejected"]))
        for name in names:
            tolerance = reward_abs if name in ("rewards/margins", "rewards/chosen", "rewards/rejected") else 1e-6
            assert a[name] == pytest.approx(b[name], rel=1e-5, abs=tolerance), name
    start = _lora_model()
    moved = {n: p for n, p in start.named_parameters() if p.requires_grad}
    assert any(not torch.equal(weights_2x1[n], moved[n]) for n in moved)  # training moved them
    for name, weight in weights_2x1.items():
        torch.testing.assert_close(weights_1x2[name], weight, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("checkpointing", ["full", pytest.param("selective", marks=pytest.mark.long)])
def test_dpo_with_regional_compile_and_checkpointing_trains_as_the_plain_run(tmp_path, checkpointing):
    """The reference pass switches the adapter off inside compiled, checkpointed layers: the
    compiled run (aot_eager on the CPU) recompiles for the switch and trains as the plain one."""
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    pairs = random_pairs(8, SEED + 5)
    plain, plain_weights = _run(tmp_path / "plain", "dpo", 2, 1, pairs)
    torch._dynamo.reset()
    cfg = tiny_config(
        tmp_path / "composed",
        adapter={"type": "lora", "lora_r": 4},
        training={"micro_batch_size": 2, "max_steps": 2, "objective": "dpo", "preference": {"beta": 0.5}},
        optimizer={"learning_rate": 1e-2, "weight_decay": 0.01, "adam_epsilon": 1e-3},  # as _run's
        performance={"torch_compile": True, "torch_compile_backend": "aot_eager", "torch_compile_scope": "regional"},
        memory={"activation_checkpointing": checkpointing},
    )
    model = _lora_model()
    facts = RunFacts(torch.device("cpu"), shape_note="pairs", lengths_vary=True)
    plan = plan_optimizations(cfg, facts)
    plan.apply(model, "adapted", cfg, facts)
    assert {"compile", "activation_checkpointing"} <= set(plan.names), plan.names
    hooks = plan.hooks(model, cfg, facts)
    train_loop(model, pairs, None, cfg, device=torch.device("cpu"), pad_id=0, console=Console(quiet=True), hooks=hooks)
    from hone.track.metrics import read_metrics

    rows = [r for r in read_metrics(cfg.training.output_dir / "metrics.jsonl") if "loss" in r]
    for a, b in zip(plain, rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        assert b["rewards/margins"] == pytest.approx(a["rewards/margins"], rel=1e-5, abs=1e-6)
    weights = {n.replace("_orig_mod.", ""): p.detach() for n, p in model.named_parameters() if p.requires_grad}
    assert weights.keys() == plain_weights.keys()
    for name, weight in plain_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=1e-5, atol=1e-5)


def test_the_reference_switch_turns_off_peft_lora_and_hones_expert_lora():
    """``adapters_off``: the model computes as its base (PEFT's LoRA on attention and its expert
    wrappers, eager experts), and hone's fused expert LoRA wrappers see their adapters disabled
    (their forward then falls back to PEFT's, which calls the base experts); all back on after."""
    from hone.config.adapter import AdapterConfig
    from hone.models.adapters import adapters_off, apply_adapter
    from hone.models.experts import set_experts_implementation
    from hone.models.experts.lora import HoneExpertsLora
    from hone.testing import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    adapter = AdapterConfig(type="lora", lora_r=4, lora_target_modules=["q_proj", "v_proj", "experts"])
    ids = torch.randint(0, len(tokenizer), (1, 12), generator=torch.Generator().manual_seed(SEED))
    base = tiny_model("tiny-qwen3-moe", tokenizer, seed=SEED)
    set_experts_implementation(base, "eager")
    with torch.no_grad():
        want = base(input_ids=ids).logits
    model = apply_adapter(base, adapter)
    gen = torch.Generator().manual_seed(SEED + 1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.1
    assert any("experts" in n and "lora_B" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        on = model(input_ids=ids).logits
        with adapters_off(model)():
            off = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert (on - want).abs().max() > 1e-3  # the adapter changes the numbers...
    torch.testing.assert_close(off, want, rtol=1e-5, atol=1e-5)  # ...and switched off, the base computes
    torch.testing.assert_close(again, on, rtol=0, atol=0)

    fused_base = tiny_model("tiny-qwen3-moe", tokenizer, seed=SEED)
    set_experts_implementation(fused_base, "hone")
    fused = apply_adapter(fused_base, adapter)
    wrappers = [m for m in fused.modules() if isinstance(m, HoneExpertsLora)]
    assert wrappers and not any(w.disable_adapters for w in wrappers)
    with adapters_off(fused)():
        assert all(w.disable_adapters for w in wrappers)
    assert not any(w.disable_adapters for w in wrappers)


def test_the_reference_switch_restores_each_layer_as_it_found_it():
    """The switch turns off only the layers that were on and turns back on only those, with their
    adapters' ``requires_grad`` as PEFT's own ``disable_adapter`` leaves them; it never builds
    PEFT's model status (a walk over every module each step)."""
    from unittest import mock

    from peft.tuners.tuners_utils import BaseTunerLayer

    from hone.config.adapter import AdapterConfig
    from hone.models.adapters import adapters_off, apply_adapter
    from hone.testing import tiny_model, tiny_tokenizer

    def state(model):
        layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        grads = {n: p.requires_grad for n, p in model.named_parameters() if "lora_" in n}
        return [layer.disable_adapters for layer in layers], grads

    def build():
        adapter = AdapterConfig(type="lora", lora_r=4, lora_target_modules=["q_proj", "v_proj"])
        model = apply_adapter(tiny_model("tiny-llama", tiny_tokenizer(), seed=SEED), adapter)
        first = next(m for m in model.modules() if isinstance(m, BaseTunerLayer))
        first.enable_adapters(False)  # one layer already off: it must stay off
        return model

    hone_model, peft_model = build(), build()
    before = state(hone_model)
    assert True in before[0] and False in before[0]
    with mock.patch.object(type(hone_model), "get_model_status", side_effect=AssertionError("status built")):
        with adapters_off(hone_model)():
            inside = state(hone_model)
    with peft_model.disable_adapter():
        assert state(peft_model)[0] == inside[0] == [True] * len(inside[0])
        assert state(peft_model)[1] == inside[1]
    assert state(hone_model) == before
