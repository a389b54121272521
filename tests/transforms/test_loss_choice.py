"""Which loss a run uses: one rule (``decide_loss``) for the run, ``hone plan`` and the estimate."""

from types import SimpleNamespace

import pytest
from torch import nn

from hone.config import parse_config
from hone.transforms.loss import LossError, chosen_loss, decide_loss, fused_loss_blockers

PLAIN = SimpleNamespace()
SOFTCAP = SimpleNamespace(final_logit_softcapping=30.0)


def _cfg(loss: str):
    return parse_config(
        {
            "model": {"preset": "tiny-llama"},
            "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca"}]},
            "performance": {"loss": loss},
        }
    )


def test_auto_takes_the_fused_loss_for_a_plain_head_and_the_standard_one_otherwise():
    head = nn.Linear(8, 16, bias=False)
    assert chosen_loss(_cfg("auto"), PLAIN, head)[0] == "fused_linear_ce"
    kind, why = chosen_loss(_cfg("auto"), SOFTCAP, head)
    assert kind == "standard" and "soft-caps" in why
    kind, why = chosen_loss(_cfg("auto"), PLAIN, nn.Linear(8, 16, bias=True))
    assert kind == "standard" and "bias" in why
    assert chosen_loss(_cfg("standard"), PLAIN, head)[0] == "standard"


def test_an_explicit_fused_loss_that_cannot_be_exact_is_refused_with_the_reason():
    with pytest.raises(LossError, match="fused_linear_ce cannot compute this model's loss exactly.*soft-caps.*auto or standard"):
        chosen_loss(_cfg("fused_linear_ce"), SOFTCAP, nn.Linear(8, 16, bias=False))


def test_plan_and_estimate_read_the_same_rule_from_the_config():
    from hone.transforms.loss import loss_decision

    for asked in ("auto", "standard", "fused_linear_ce"):
        cfg = _cfg(asked)
        assert loss_decision(cfg) == decide_loss(asked, fused_loss_blockers(SimpleNamespace(), None))
    assert decide_loss("auto", fused_loss_blockers(SOFTCAP, None))[0] == "standard"
