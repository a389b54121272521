"""The preference objectives on their own (no TRL needed): the formulas on hand-checkable
numbers, the metric names, ORPO's default NLL, and clear errors for bad input."""

import math

import pytest
import torch

from hone.runtime.preference_loss import dpo, ipo, log1mexp, orpo

NAMES = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"}


def _pairs(seed=0, n=4):
    gen = torch.Generator().manual_seed(seed)
    return [(-30 * torch.rand(n, generator=gen) - 1).requires_grad_(True) for _ in range(4)]


def test_dpo_formula_metrics_and_gradient_sign():
    chosen, rejected, ref_chosen, ref_rejected = _pairs()
    out = dpo(chosen, rejected, ref_chosen.detach(), ref_rejected.detach(), beta=0.2)
    delta = (chosen - ref_chosen) - (rejected - ref_rejected)
    expected = [math.log1p(math.exp(-0.2 * d)) for d in delta.tolist()]
    torch.testing.assert_close(out.pair_losses, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert set(out.metrics) == NAMES and all(not m.requires_grad and m.dim() == 0 for m in out.metrics.values())
    margins = 0.2 * delta
    assert out.metrics["rewards/accuracies"].item() == pytest.approx((margins > 0).float().mean().item())
    out.loss.backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()  # raise chosen, lower rejected


def test_dpo_label_smoothing_is_conservative_dpo():
    chosen, rejected, ref_chosen, ref_rejected = (t.detach() for t in _pairs(1))
    eps, beta = 0.25, 0.1
    out = dpo(chosen, rejected, ref_chosen, ref_rejected, beta=beta, label_smoothing=eps)
    d = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    expected = -(1 - eps) * torch.nn.functional.logsigmoid(d) - eps * torch.nn.functional.logsigmoid(-d)
    torch.testing.assert_close(out.pair_losses, expected)


def test_ipo_normalises_by_token_counts_and_clamps_empty():
    chosen, rejected, ref_chosen, ref_rejected = (t.detach() for t in _pairs(2, n=2))
    counts_c, counts_r = torch.tensor([5.0, 0.0]), torch.tensor([3.0, 7.0])
    out = ipo(chosen, rejected, ref_chosen, ref_rejected, counts_c, counts_r, beta=0.5)
    d = (chosen - ref_chosen) / torch.tensor([5.0, 1.0]) - (rejected - ref_rejected) / counts_r
    torch.testing.assert_close(out.pair_losses, (d - 1.0) ** 2)


def test_orpo_default_nll_is_the_chosen_token_mean():
    chosen, rejected = torch.tensor([-12.0, -30.0]), torch.tensor([-20.0, -25.0])
    counts_c, counts_r = torch.tensor([6.0, 10.0]), torch.tensor([8.0, 5.0])
    out = orpo(chosen, rejected, counts_c, counts_r, beta=0.1)
    assert out.metrics["nll_loss"].item() == pytest.approx(42.0 / 16.0)
    a_c, a_r = chosen / counts_c, rejected / counts_r
    log_odds = (a_c - a_r) - (torch.log(1 - torch.exp(a_c)) - torch.log(1 - torch.exp(a_r)))
    expected = 42.0 / 16.0 - 0.1 * torch.nn.functional.logsigmoid(log_odds).mean()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert out.metrics["logps/chosen"].item() == pytest.approx(a_c.mean().item())
    assert {"nll_loss", "log_odds_ratio", "log_odds_chosen"} <= set(out.metrics)


def test_log1mexp_is_accurate_on_both_branches():
    x = torch.tensor([-1e-6, -0.5, -0.7, -5.0, -40.0], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), torch.log(-torch.expm1(x)))


def test_bad_inputs_name_the_value():
    a = torch.zeros(3)
    with pytest.raises(ValueError, match="beta must be > 0, got 0"):
        dpo(a, a, a, a, beta=0)
    with pytest.raises(ValueError, match=r"label_smoothing must lie in \[0, 0.5\), got 0.5"):
        dpo(a, a, a, a, label_smoothing=0.5)
    with pytest.raises(ValueError, match="one length P"):
        ipo(a, a, a, a, a, torch.zeros(2))
    with pytest.raises(ValueError, match="one length P"):
        orpo(a.reshape(3, 1), a.reshape(3, 1), a, a)
