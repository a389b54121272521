"""``performance.fp8_head``: the frozen output head in float8 inside the fused loss. Config and
plan refusals (each naming the key and what is allowed), the loss the transform builds against
the float8 reference on a tiny LoRA model (CPU ``torch._scaled_mm``), and the memory estimate's
two float8 copies of the head."""

from types import SimpleNamespace

import pytest
import torch

from hone.config import parse_config
from hone.config.errors import ConfigError
from hone.kernels.cross_entropy_fp8 import linear_cross_entropy_fp8_reference
from hone.kernels.fp8_linear import quantize_frozen_weight
from hone.models.structure import causal_lm_parts
from hone.testing import tiny_model, tiny_tokenizer, with_random_lora
from hone.transforms.base import PlanContext, RunFacts
from hone.transforms.decide import decide
from hone.transforms.fp8 import FP8
from hone.transforms.loss import LossError, build_loss

_DATA = {"datasets": [{"path": "d.jsonl", "type": "alpaca"}]}
CUDA = torch.device("cuda")


def _cfg(adapter=None, training=None, data=None, **performance):
    return parse_config(
        {
            "model": {"preset": "tiny-llama", "dtype": "bfloat16"},
            "data": data or _DATA,
            "adapter": adapter or {"type": "lora"},
            "training": training or {},
            "performance": {"fp8": "rowwise", "fp8_head": True, **performance},
        }
    )


def _head_problems(config):
    facts = RunFacts(CUDA)
    return [p for p in FP8.check(PlanContext(config, facts, decide(config, facts))) if "fp8_head" in p]


def test_fp8_head_needs_fp8_on():
    with pytest.raises(ConfigError, match="fp8_head: True only applies with fp8 on"):
        _cfg(fp8="off")


def test_a_lora_run_with_the_fused_loss_takes_it():
    assert _head_problems(_cfg()) == []


@pytest.mark.parametrize(
    "config, says",
    [
        (lambda: _cfg(adapter={"type": "none"}), "applies to a frozen output head (LoRA)"),
        (lambda: _cfg(loss="standard"), "but the loss is standard (performance.loss: standard)"),
        (lambda: _cfg(adapter={"type": "lora", "lora_modules_to_save": ["lm_head"]}), "lora_modules_to_save trains lm_head"),
        (
            lambda: _cfg(training={"objective": "dpo"}, data={"datasets": [{"path": "p.jsonl", "type": "preference"}]}),
            "training.objective: dpo computes per-sequence log-probabilities",
        ),
    ],
    ids=["full-finetune", "standard-loss", "trained-head", "preference"],
)
def test_the_plan_refuses_it_where_it_cannot_apply_naming_the_key(config, says):
    (problem,) = _head_problems(config())
    assert problem.startswith("performance.fp8_head: true") and says in problem and "fp8_head: false" in problem


def test_the_loss_it_builds_is_the_float8_heads_and_reaches_the_hidden_states():
    torch.manual_seed(0)
    config = _cfg()
    model = with_random_lora(tiny_model("tiny-llama", tiny_tokenizer()), seed=0)
    head = causal_lm_parts(model)[1]
    loss_fn, record = build_loss(config, RunFacts(torch.device("cpu")), model, float8=True)
    assert record["head"].startswith("float8 rowwise")

    hidden = torch.randn(2, 24, head.weight.shape[1], requires_grad=True)
    targets = torch.randint(0, head.weight.shape[0], (2, 24))
    targets[0, :3] = -100
    loss = loss_fn(hidden, head, SimpleNamespace(targets=targets))
    loss.backward()
    reference_hidden = hidden.detach().clone().requires_grad_(True)
    float8_head = quantize_frozen_weight(head.weight.detach(), "rowwise")
    want = linear_cross_entropy_fp8_reference(reference_hidden.reshape(-1, hidden.shape[-1]), float8_head, targets.reshape(-1))
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, reference_hidden.grad, rtol=1e-5, atol=1e-6)

    _, plain = build_loss(config, RunFacts(torch.device("cpu")), model, float8=False)  # fp8 decided off: the bf16 head
    assert "head" not in plain


def test_a_trained_head_is_refused_when_the_loss_is_built():
    model = tiny_model("tiny-llama", tiny_tokenizer())  # no adapter: every weight trains
    with pytest.raises(LossError, match="performance.fp8_head: true needs a frozen output head"):
        build_loss(_cfg(), RunFacts(torch.device("cpu")), model, float8=True)


def test_the_estimate_counts_two_float8_copies_of_the_head():
    from hone.transforms.memory.facts import model_facts
    from hone.transforms.memory.terms.fp8 import fp8_copies_bytes

    with_head, without = _cfg(), _cfg(fp8_head=False)
    m = model_facts(with_head)
    assert fp8_copies_bytes(with_head, m) - fp8_copies_bytes(without, model_facts(without)) == 2 * m.vocab * m.hidden
