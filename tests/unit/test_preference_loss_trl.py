"""hone's DPO, IPO and ORPO against TRL's own trainer code (TRL 1.16: ``DPOTrainer._compute_loss``,
``trl.experimental.orpo.ORPOTrainer.get_batch_loss_metrics``), called on minimal stand-in
objects: losses, gradients w.r.t. the logits and the logged metrics within 1e-5 in fp32.

Both sides start from the same random logits ``[2P, T, V]`` (TRL's layout: P chosen rows, then
P rejected rows, prompt first, then the completion, then padding). TRL computes its per-token
log-probs from them its own way; hone takes them through :func:`sequence_logprobs` (hidden =
the logits rows, head = the identity, so its projection returns the logits unchanged) with one
segment per sequence, as the packed path will. Skipped when trl is not installed.
"""

import types
from collections import defaultdict

import pytest
import torch

from hone.kernels.sequence_logprobs import segment_token_counts, sequence_logprobs
from hone.runtime.preference_loss import dpo, ipo, orpo

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
trl_orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")

P, T, V = 3, 12, 11
IGNORE = -100


def _batch(seed: int, pairs: int = P):
    """Random logits (a leaf), token ids, and masks: prompt lengths 2-4, completions >= 3 tokens,
    trailing padding."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(2 * pairs, T, V, generator=gen) * 2).requires_grad_(True)
    input_ids = torch.randint(0, V, (2 * pairs, T), generator=gen)
    attention = torch.zeros(2 * pairs, T, dtype=torch.long)
    completion = torch.zeros(2 * pairs, T, dtype=torch.long)
    prompt_len = torch.randint(2, 5, (pairs,), generator=gen)
    for row in range(2 * pairs):
        start = int(prompt_len[row % pairs])
        end = start + int(torch.randint(3, T - start + 1, (1,), generator=gen))
        attention[row, :end] = 1
        completion[row, start:end] = 1
    return logits, input_ids, attention, completion


def _hone_logps(logits, input_ids, attention, completion, prompt_segments=False, pairs=P):
    """Per-sequence sums and token counts through the fused kernel: segment r for the completion
    of row r; with ``prompt_segments``, segment 2P + p for the prompt tokens of chosen row p
    (ORPO's NLL in TRL covers them)."""
    rows = torch.arange(2 * pairs).unsqueeze(1).expand(2 * pairs, T - 1)
    shift_completion, shift_attention = completion[:, 1:].bool(), attention[:, 1:].bool()
    segments = torch.where(shift_completion, rows, -1)
    if prompt_segments:
        chosen_prompt = shift_attention & ~shift_completion & (rows < pairs)
        segments = torch.where(chosen_prompt, rows + 2 * pairs, segments)
    n_segments = 3 * pairs if prompt_segments else 2 * pairs
    hidden = logits[:, :-1].reshape(-1, V)
    targets, segments = input_ids[:, 1:].reshape(-1), segments.reshape(-1)
    sums = sequence_logprobs(hidden, torch.eye(V), targets, segments, n_segments, chunk_tokens=7)
    return sums, segment_token_counts(targets, segments, n_segments)


def _stand_in_model(logits):
    """What TRL's model call returns with ``fused_lm_head=True``: per-token log-probs of the
    labels (0 where the label is -100), plus the logged extras."""

    def forward(input_ids, attention_mask, labels, use_cache, fused_lm_head):
        shifted = labels[:, 1:]
        counted = shifted != IGNORE
        per_token = logits[:, :-1].log_softmax(-1).gather(2, torch.where(counted, shifted, 0).unsqueeze(2)).squeeze(2)
        zeros = torch.zeros_like(per_token)
        return types.SimpleNamespace(log_probs=per_token * counted, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    return forward


def _identity_accelerator():
    return types.SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)


def _trl_dpo(loss_type, beta, logits, input_ids, attention, completion, ref_chosen, ref_rejected, label_smoothing=0.0):
    """TRL's ``DPOTrainer._compute_loss`` on a stand-in trainer: its loss and its logged metrics."""
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=_identity_accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    loss = trl_dpo.DPOTrainer._compute_loss(trainer, _stand_in_model(logits), inputs, False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _assert_metrics(hone_metrics, trl_metrics, names):
    for name in names:
        assert hone_metrics[name].item() == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6), name


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.mark.parametrize("loss_type, beta, seed", [("sigmoid", 0.1, 0), ("sigmoid", 0.5, 1), ("ipo", 0.1, 2), ("ipo", 0.7, 3)])
def test_dpo_and_ipo_loss_gradient_and_metrics_equal_trl(loss_type, beta, seed):
    logits, input_ids, attention, completion = _batch(seed)
    gen = torch.Generator().manual_seed(seed + 50)
    ref_chosen, ref_rejected = -20 - 5 * torch.rand(P, generator=gen), -20 - 5 * torch.rand(P, generator=gen)

    trl_loss, trl_metrics = _trl_dpo(loss_type, beta, logits, input_ids, attention, completion, ref_chosen, ref_rejected)
    (trl_grad,) = torch.autograd.grad(trl_loss, logits)

    sums, counts = _hone_logps(logits, input_ids, attention, completion)
    if loss_type == "sigmoid":
        out = dpo(sums[:P], sums[P:], ref_chosen, ref_rejected, beta=beta)
    else:
        out = ipo(sums[:P], sums[P:], ref_chosen, ref_rejected, counts[:P], counts[P:], beta=beta)
    (hone_grad,) = torch.autograd.grad(out.loss, logits)

    assert trl_grad.abs().sum() > 0
    torch.testing.assert_close(out.loss, trl_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hone_grad, trl_grad, rtol=1e-5, atol=1e-6)
    _assert_metrics(out.metrics, trl_metrics, METRICS)
    torch.testing.assert_close(out.pair_losses.mean(), out.loss)


@pytest.mark.parametrize("label_smoothing, seed", [(0.1, 5), (0.3, 6)])
def test_dpo_label_smoothing_equals_trl_with_one_pair(label_smoothing, seed):
    """TRL 1.16's sigmoid loss ignores ``label_smoothing``; its ``aot_unpaired`` loss sorts the
    batch's log-ratios (a no-op for one pair) and then is exactly conservative DPO."""
    logits, input_ids, attention, completion = _batch(seed, pairs=1)
    ref_chosen, ref_rejected = torch.tensor([-21.5]), torch.tensor([-23.0])
    trl_loss, trl_metrics = _trl_dpo(
        "aot_unpaired", 0.2, logits, input_ids, attention, completion, ref_chosen, ref_rejected, label_smoothing
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, logits)
    sums, _ = _hone_logps(logits, input_ids, attention, completion, pairs=1)
    out = dpo(sums[:1], sums[1:], ref_chosen, ref_rejected, beta=0.2, label_smoothing=label_smoothing)
    (hone_grad,) = torch.autograd.grad(out.loss, logits)
    torch.testing.assert_close(out.loss, trl_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hone_grad, trl_grad, rtol=1e-5, atol=1e-6)
    _assert_metrics(out.metrics, trl_metrics, METRICS)
    no_smoothing = dpo(sums[:1], sums[1:], ref_chosen, ref_rejected, beta=0.2)
    assert abs(no_smoothing.loss.item() - out.loss.item()) > 1e-4


def test_the_trl_comparison_catches_a_missing_length_normalisation():
    """IPO without TRL's per-token normalisation must differ from TRL: the test above can fail."""
    logits, input_ids, attention, completion = _batch(4)
    ref_chosen, ref_rejected = torch.full((P,), -22.0), torch.full((P,), -21.0)
    trl_loss, _ = _trl_dpo("ipo", 0.1, logits, input_ids, attention, completion, ref_chosen, ref_rejected)
    sums, _ = _hone_logps(logits, input_ids, attention, completion)
    unnormalised = ipo(sums[:P], sums[P:], ref_chosen, ref_rejected, torch.ones(P), torch.ones(P), beta=0.1)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(unnormalised.loss, trl_loss, rtol=1e-5, atol=1e-6)


def _trl_orpo(beta, logits, input_ids, attention, completion):
    """TRL's ``ORPOTrainer.get_batch_loss_metrics`` (with its real ``concatenated_forward``,
    ``get_batch_logps`` and ``odds_ratio_loss``) on a stand-in trainer and model."""
    orpo_trainer = trl_orpo.ORPOTrainer
    trainer = types.SimpleNamespace(
        accelerator=_identity_accelerator(),
        aux_loss_enabled=False,
        is_encoder_decoder=False,
        padding_value=0,
        beta=beta,
        concatenated_inputs=orpo_trainer.concatenated_inputs,
        get_batch_logps=orpo_trainer.get_batch_logps,
    )
    trainer.concatenated_forward = types.MethodType(orpo_trainer.concatenated_forward, trainer)
    trainer.odds_ratio_loss = types.MethodType(orpo_trainer.odds_ratio_loss, trainer)
    labels = torch.where(completion.bool(), input_ids, IGNORE)
    batch = {}
    for name, rows in (("chosen", slice(0, P)), ("rejected", slice(P, 2 * P))):
        batch[f"{name}_input_ids"] = input_ids[rows]
        batch[f"{name}_attention_mask"] = attention[rows]
        batch[f"{name}_labels"] = labels[rows]

    def model(input_ids, attention_mask, use_cache):
        return types.SimpleNamespace(logits=logits)

    return orpo_trainer.get_batch_loss_metrics(trainer, model, batch)


@pytest.mark.parametrize("beta, seed", [(0.1, 0), (1.0, 1)])
def test_orpo_loss_gradient_and_metrics_equal_trl(beta, seed):
    logits, input_ids, attention, completion = _batch(seed)
    trl_loss, trl_metrics = _trl_orpo(beta, logits, input_ids, attention, completion)
    (trl_grad,) = torch.autograd.grad(trl_loss, logits)

    sums, counts = _hone_logps(logits, input_ids, attention, completion, prompt_segments=True)
    # TRL's NLL: the token mean over the chosen rows' prompt and completion tokens.
    nll = -(sums[:P].sum() + sums[2 * P :].sum()) / (counts[:P].sum() + counts[2 * P :].sum())
    out = orpo(sums[:P], sums[P : 2 * P], counts[:P], counts[P : 2 * P], nll=nll, beta=beta)
    (hone_grad,) = torch.autograd.grad(out.loss, logits)

    torch.testing.assert_close(out.loss, trl_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hone_grad, trl_grad, rtol=1e-5, atol=1e-6)
    _assert_metrics(out.metrics, trl_metrics, (*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"))
