"""Preference objectives (DPO, IPO, ORPO) as pure functions of per-sequence log-probabilities.

Each objective takes, for a batch of ``P`` pairs, the policy's summed completion log-probs of
the chosen and the rejected completion (``[P]`` each, e.g. from
:func:`hone.kernels.sequence_logprobs.sequence_logprobs`), plus whatever else it needs (the
reference model's log-probs, the completions' token counts), and returns a
:class:`PreferenceLoss`: TRL's scalar loss, the per-pair terms, and TRL's metrics under TRL's
names. Nothing here knows about models, batches or the training loop; the numbers equal TRL
1.16's trainers' (tests/unit/test_preference_loss_trl.py compares losses, gradients and metrics).

Conventions (TRL 1.16.0, ``trl/trainer/dpo_trainer.py`` ``DPOTrainer._compute_loss`` and
``trl/experimental/orpo/orpo_trainer.py``):

- The loss is the **mean** over pairs. hone's principle of dividing by the whole accumulation
  window (DESIGN.md, principle 5) applies to pairs here: sum :attr:`PreferenceLoss.pair_losses`
  over the micro-batch and divide by the window's pair count (and ORPO's NLL as a token sum
  over the window's tokens), so ``micro_batch x accum`` shapes give the same gradients.
- Rewards are ``beta * (policy - reference)`` summed log-probs (DPO and IPO alike: TRL does
  not length-normalise IPO's rewards, only its loss); accuracies count pairs whose chosen
  reward is strictly greater; metrics are means over the pairs, detached, float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PreferenceLoss:
    """``loss``: the scalar to minimise (TRL's value, a mean over the ``P`` pairs, plus ORPO's
    NLL); ``pair_losses`` ``[P]``: the per-pair preference terms (``loss == pair_losses.mean()``
    for DPO and IPO, ``loss == nll + pair_losses.mean()`` for ORPO); ``metrics``: detached
    float32 scalars named as TRL logs them."""

    loss: torch.Tensor
    pair_losses: torch.Tensor
    metrics: dict[str, torch.Tensor]


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}")


def _check_pairs(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 1 or any(shape != first for shape in shapes.values()):
        raise ValueError(f"expected 1-D tensors of one length P (one entry per pair), got {shapes}")


def _reward_metrics(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor
) -> dict[str, torch.Tensor]:
    chosen_rewards, rejected_rewards = chosen_rewards.detach().float(), rejected_rewards.detach().float()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.detach().float().mean(),
        "logps/rejected": rejected_logps.detach().float().mean(),
    }


def dpo(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> PreferenceLoss:
    """DPO's sigmoid loss (Rafailov et al. 2023), with conservative-DPO label smoothing ``eps``:

        d = (chosen - ref_chosen) - (rejected - ref_rejected)          (summed log-probs)
        loss_p = -(1 - eps) * log sigmoid(beta * d) - eps * log sigmoid(-beta * d)

    With ``eps = 0`` this is TRL 1.16's ``loss_type="sigmoid"`` exactly. TRL 1.16's sigmoid
    loss has no label smoothing any more (TRL <= 0.x applied ``label_smoothing`` to it with this
    very formula, as TRL 1.16 still does for ``aot``); ``eps`` must lie in ``[0, 0.5)``.
    """
    _check_beta(beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing!r}")
    _check_pairs(
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    pair_losses = -F.logsigmoid(beta * delta)
    if label_smoothing:
        pair_losses = (1 - label_smoothing) * pair_losses - label_smoothing * F.logsigmoid(-beta * delta)
    metrics = _reward_metrics(beta * chosen_logratios, beta * rejected_logratios, chosen_logps, rejected_logps)
    return PreferenceLoss(pair_losses.mean(), pair_losses, metrics)


def ipo(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    beta: float = 0.1,
) -> PreferenceLoss:
    """IPO (Azar et al. 2023, eq. 17) with TRL 1.16's length normalisation:

        d = (chosen - ref_chosen) / n_chosen - (rejected - ref_rejected) / n_rejected
        loss_p = (d - 1 / (2 * beta)) ** 2

    where ``n`` are the completions' token counts (clamped to at least 1), as TRL 1.16's
    ``loss_type="ipo"`` (the IPO authors' normalised form). The rewards in the metrics are the
    unnormalised ``beta * (policy - reference)``, as TRL logs them.
    """
    _check_beta(beta)
    _check_pairs(
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
        chosen_tokens=chosen_tokens,
        rejected_tokens=rejected_tokens,
    )
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios / chosen_tokens.clamp(min=1.0) - rejected_logratios / rejected_tokens.clamp(min=1.0)
    pair_losses = (delta - 1 / (2 * beta)) ** 2
    metrics = _reward_metrics(beta * chosen_logratios, beta * rejected_logratios, chosen_logps, rejected_logps)
    return PreferenceLoss(pair_losses.mean(), pair_losses, metrics)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation (Maechler 2012: branch at -ln 2),
    as TRL's ORPO computes it."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    nll: torch.Tensor | None = None,
    beta: float = 0.1,
) -> PreferenceLoss:
    """ORPO (Hong et al. 2024), reference-free: the chosen completions' NLL plus the odds-ratio
    term on the **average** per-token log-probs ``a = logps / n``:

        log_odds = (a_chosen - a_rejected) - (log(1 - exp(a_chosen)) - log(1 - exp(a_rejected)))
        loss_p = -beta * log sigmoid(log_odds);   loss = nll + mean(loss_p)

    as TRL 1.16's ``trl.experimental.orpo.ORPOTrainer`` (``odds_ratio_loss``; ``beta`` is its
    ``lambda``). ``nll`` defaults to the token mean of the chosen completions' NLL,
    ``-sum(chosen_logps) / sum(chosen_tokens)``; TRL takes its NLL over the chosen rows'
    **prompt and completion** tokens, so to match TRL pass that mean (sum the prompt tokens'
    log-probs as their own segments). Metrics as TRL's: rewards are ``beta * a`` and
    ``logps/*`` the averages ``a``; plus ``nll_loss``, ``log_odds_ratio`` (mean of
    ``log sigmoid(log_odds)``) and ``log_odds_chosen`` (mean of ``log_odds``). TRL's
    ``logits/chosen`` / ``logits/rejected`` need the logits, which the fused path never has.
    """
    _check_beta(beta)
    _check_pairs(
        chosen_logps=chosen_logps, rejected_logps=rejected_logps, chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens
    )
    chosen_avg = chosen_logps.float() / chosen_tokens.float().clamp(min=1.0)
    rejected_avg = rejected_logps.float() / rejected_tokens.float().clamp(min=1.0)
    if nll is None:
        nll = -chosen_logps.float().sum() / chosen_tokens.float().sum().clamp(min=1.0)
    log_odds = (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))
    ratio = F.logsigmoid(log_odds)
    pair_losses = -beta * ratio
    metrics = _reward_metrics(beta * chosen_avg, beta * rejected_avg, chosen_avg, rejected_avg)
    metrics["nll_loss"] = nll.detach().float()
    metrics["log_odds_ratio"] = ratio.detach().mean()
    metrics["log_odds_chosen"] = log_odds.detach().mean()
    return PreferenceLoss(nll + pair_losses.mean(), pair_losses, metrics)
