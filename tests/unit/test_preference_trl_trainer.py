"""hone's whole preference path against TRL 1.16's trainers on a real (tiny) model: the pairs
collated into one packed row, the packed forward, :func:`sequence_logprobs` on the last hidden
states, the objective and the window's normalisation, against TRL's ``DPOTrainer._compute_loss``
(DPO, IPO via ``loss_type``; TRL's own fused LM head, its PEFT reference with the adapter
disabled) and ``trl.experimental.orpo.ORPOTrainer.get_batch_loss_metrics`` (ORPO). Losses and
gradients of the LoRA factors (and of every weight of a full fine-tune) within 1e-5 in fp32
(relative, each weight's gradient as a whole).

TRL's methods run on a stand-in trainer object holding only the attributes they read (building
a whole ``DPOTrainer`` needs a dataset, a tokenizer and an output directory). Both sides get the
same pairs, in TRL's layout on TRL's side: P chosen rows then P rejected rows, prompt then
completion, right padding. Skipped when trl is not installed.
"""

import copy
import os
import random
import types
from collections import defaultdict

import pytest
import torch

from hone.data.pairs import collate_pairs
from hone.models.adapters import adapters_off
from hone.models.attention.layout import layout_for
from hone.runtime.pair_loss import PairLoss, window_values
from hone.runtime.step import micro_batch_loss
from hone.testing import norm_error, tiny_llama, with_random_lora
from hone.train.setup import step_metric_names
from hone.train.train_step import pair_divisor, window_share

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
trl_orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

SEED = int(os.environ.get("HONE_TEST_SEED", random.randrange(10_000)))  # fresh each session; fix it to reproduce
P = 3
IGNORE = -100


def _pairs(seed: int) -> list[dict[str, list[int]]]:
    gen = random.Random(seed)

    def ids(low: int, high: int) -> list[int]:
        return [gen.randrange(1, 97) for _ in range(gen.randint(low, high))]

    return [{"prompt_ids": ids(2, 7), "chosen_ids": ids(2, 6), "rejected_ids": ids(2, 6)} for _ in range(P)]


def _trl_rows(pairs) -> dict[str, torch.Tensor]:
    """TRL's collated DPO batch: P chosen rows, then P rejected rows, right-padded."""
    rows = [(p["prompt_ids"], p[key]) for key in ("chosen_ids", "rejected_ids") for p in pairs]
    width = max(len(a) + len(b) for a, b in rows)
    input_ids = torch.zeros(2 * P, width, dtype=torch.long)
    attention = torch.zeros(2 * P, width, dtype=torch.long)
    completion = torch.zeros(2 * P, width, dtype=torch.long)
    for r, (prompt, answer) in enumerate(rows):
        n = len(prompt) + len(answer)
        input_ids[r, :n] = torch.tensor(prompt + answer)
        attention[r, :n] = 1
        completion[r, len(prompt) : n] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}


def _models(lora: bool):
    torch.manual_seed(SEED)  # PEFT draws the A factors from the global generator
    model = tiny_llama(SEED, freeze_embeddings=False)
    model.config._attn_implementation = "sdpa"
    if lora:
        model = with_random_lora(model, SEED + 1)
    model.train()
    return model, copy.deepcopy(model)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _hone(model, pairs, objective: str, beta: float, reference=None, share=False) -> tuple[torch.Tensor, dict[str, float]]:
    """hone's loss of one window holding the pairs, through the training path (backward done),
    and the metrics the step logs (``share``: each prompt once, the two completions as branches)."""
    batch = collate_pairs(pairs, pad_id=0, prompt_nll=objective == "orpo", share_prompt=share)
    batch = batch.with_attention(layout_for(model, shares_prompt=share))
    if reference is not None:
        batch.reference_logps = reference
    reference_off = adapters_off(model) if reference is None and objective != "orpo" else None
    sums = micro_batch_loss(model, batch, PairLoss(objective, beta, reference_off=reference_off))
    divisor = pair_divisor(batch.nll_tokens, batch.pairs, torch.device("cpu"))
    loss = window_share(sums, divisor)
    loss.backward()
    values = window_values(sums.detach(), divisor).tolist()
    names = step_metric_names(objective)
    metrics = {name: value for name, value in zip(names, values[1:], strict=True) if name is not None}
    return loss.detach(), metrics


def _trl_dpo_loss(model, pairs, loss_type: str, beta: float, reference=None) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's ``DPOTrainer._compute_loss`` on ``model`` (its fused LM head added as TRL's trainer
    adds it); the reference from the adapter-disabled model, or ``reference`` precomputed."""
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")  # what DPOTrainer.__init__ asks for
    trl_utils.add_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model, outputs=outputs)
    trainer = types.SimpleNamespace(
        model=model,
        ref_model=None,
        accelerator=types.SimpleNamespace(
            device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x, unwrap_model=lambda m: m
        ),
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=reference is not None,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = _trl_rows(pairs)
    if reference is not None:
        inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = reference[:P], reference[P:]
    loss = trl_dpo.DPOTrainer._compute_loss(trainer, model, inputs, False)
    loss.backward()
    return loss.detach(), {name: float(values[-1]) for name, values in trainer._metrics["train"].items()}


def _trl_orpo_loss(model, pairs, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's ``ORPOTrainer.get_batch_loss_metrics`` on ``model`` (its own forward, logits and NLL)."""
    orpo_trainer = trl_orpo.ORPOTrainer
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x),
        aux_loss_enabled=False,
        is_encoder_decoder=False,
        padding_value=0,
        label_pad_token_id=IGNORE,
        beta=beta,
        concatenated_inputs=orpo_trainer.concatenated_inputs,
        get_batch_logps=orpo_trainer.get_batch_logps,
    )
    trainer.concatenated_forward = types.MethodType(orpo_trainer.concatenated_forward, trainer)
    trainer.odds_ratio_loss = types.MethodType(orpo_trainer.odds_ratio_loss, trainer)
    rows = _trl_rows(pairs)
    labels = torch.where(rows["completion_mask"].bool(), rows["input_ids"], IGNORE)
    batch = {}
    for name, part in (("chosen", slice(0, P)), ("rejected", slice(P, 2 * P))):
        batch[f"{name}_input_ids"] = rows["input_ids"][part]
        batch[f"{name}_attention_mask"] = rows["attention_mask"][part]
        batch[f"{name}_labels"] = labels[part]
    loss, metrics = orpo_trainer.get_batch_loss_metrics(trainer, model, batch)
    loss.backward()
    return loss.detach(), {name: float(value) for name, value in metrics.items()}


def _assert_same(hone_model, trl_model, hone_out, trl_out):
    (hone_loss, hone_metrics), (trl_loss, trl_metrics) = hone_out, trl_out
    torch.testing.assert_close(hone_loss, trl_loss, rtol=1e-5, atol=1e-6)
    assert len(hone_metrics) >= 6
    # rewards are beta (<= 1 here) x differences of summed log-probs: they round as the log-probs do
    reward_abs = 1e-5 * max(abs(float(hone_metrics["logps/chosen"])), abs(float(hone_metrics["logps/rejected"])), 0.1)
    for name, value in hone_metrics.items():  # the metrics the step logs, under TRL's names and values
        tolerance = reward_abs if name.startswith("rewards/") and name != "rewards/accuracies" else 1e-6
        assert value == pytest.approx(trl_metrics[name], rel=1e-5, abs=tolerance), name
    hone_grads, trl_grads = _grads(hone_model), _grads(trl_model)
    assert hone_grads.keys() == trl_grads.keys() and sum(g.abs().sum() for g in trl_grads.values()) > 0
    names = list(trl_grads)
    every = norm_error(torch.cat([hone_grads[n].flatten() for n in names]), torch.cat([trl_grads[n].flatten() for n in names]))
    assert every < 1e-5, every  # all gradients together (summation orders differ: one packed row against padded rows)
    for name, grad in trl_grads.items():
        # each weight's own: the first layer's small LoRA factors carry the rounding of every layer above
        # them (a random seed gave 1.05e-5 for layer 0's v_proj lora_A)
        assert norm_error(hone_grads[name], grad) < 3e-5, (name, norm_error(hone_grads[name], grad))


SHARE = pytest.mark.parametrize("share", [False, True], ids=["prompt-twice", "prompt-shared"])


@SHARE
@pytest.mark.parametrize("objective, loss_type, beta", [("dpo", "sigmoid", 0.5), ("ipo", "ipo", 0.3)])
def test_lora_dpo_and_ipo_with_the_adapter_switched_off_equal_trl(objective, loss_type, beta, share):
    ours, theirs = _models(lora=True)
    pairs = _pairs(SEED + 2)
    _assert_same(ours, theirs, _hone(ours, pairs, objective, beta, share=share), _trl_dpo_loss(theirs, pairs, loss_type, beta))


@SHARE
def test_full_fine_tune_dpo_with_given_reference_log_probs_equals_trl(share):
    ours, theirs = _models(lora=False)
    pairs = _pairs(SEED + 3)
    reference = -30 - 5 * torch.rand(2 * P, generator=torch.Generator().manual_seed(SEED))
    hone = _hone(ours, pairs, "dpo", 0.2, reference, share=share)
    _assert_same(ours, theirs, hone, _trl_dpo_loss(theirs, pairs, "sigmoid", 0.2, reference))


@SHARE
@pytest.mark.parametrize("lora", [True, False])
def test_orpo_equals_trl(lora, share):
    ours, theirs = _models(lora=lora)
    pairs = _pairs(SEED + 4)
    _assert_same(ours, theirs, _hone(ours, pairs, "orpo", 0.4, share=share), _trl_orpo_loss(theirs, pairs, 0.4))
