"""``memory.offload_layers``: some layers' checkpointed inputs on the host, the rest on the
device. The split only moves tensors, so loss and gradients equal those without checkpointing
(CPU, fp32), for LoRA and full fine-tuning; the offloader moves exactly the first k inputs."""

import pytest
import torch

from hone.config.memory import MemoryConfig
from hone.testing import offload_step, tiny_model, tiny_tokenizer, with_random_lora
from hone.transforms.checkpointing import apply_activation_checkpointing, offloader_for
from hone.transforms.offload import OffloadActivations

LAYERS = 3


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _model(tokenizer, adapter):
    model = tiny_model("tiny-llama", tokenizer, seed=31, num_hidden_layers=LAYERS)
    model.config._attn_implementation = "sdpa"
    if adapter == "lora":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(32)
            model = with_random_lora(model, seed=33)
    return model.train()


@pytest.mark.parametrize("adapter", ["lora", "full"])
@pytest.mark.parametrize("kept_on_host", [0, 1, 2])
def test_a_partial_offload_gives_the_gradients_of_no_checkpointing(adapter, kept_on_host, tokenizer):
    ids = torch.randint(7, 300, (2, 20), generator=torch.Generator().manual_seed(34))
    loss_ref, ref = offload_step(_model(tokenizer, adapter), ids)
    model = _model(tokenizer, adapter)
    record = apply_activation_checkpointing(model, "offload", offload_min_bytes=1, offload_layers=kept_on_host)
    assert record["offload"]["layers_offloaded"] == kept_on_host
    loss, grads = offload_step(model, ids)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
    assert grads.keys() == ref.keys() and ref
    for name, want in ref.items():
        assert want.abs().max() > 0, name
        err = (grads[name] - want).abs().max() / want.abs().max()
        assert err <= 1e-5, f"{name}: relative difference {err:.2e}"
    stats = offloader_for(model).stats
    # with LoRA, layer 0's input is a leaf autograd holds anyway: only layers 1.. qualify
    eligible = LAYERS - 1 if adapter == "lora" else LAYERS
    assert stats.packed == min(kept_on_host, eligible)
    assert stats.shapes == [(2, 20, 64)] * stats.packed


def test_the_offloader_moves_the_first_tensors_and_keeps_the_rest():
    off = OffloadActivations(min_bytes=1, use_streams=False, max_tensors=2)
    x = torch.randn(4, 8, requires_grad=True)
    with off.step_context():
        y = x * 1.5
        chain = [y]
        for _ in range(4):
            chain.append(torch.sin(chain[-1]))  # sin saves its input
        chain[-1].sum().backward()
        assert off.stats.packed == 2 and off.stats.kept >= 2
    torch.testing.assert_close(x.grad, torch.autograd.grad(_chain(x), x)[0])


def _chain(x):
    y = x * 1.5
    for _ in range(4):
        y = torch.sin(y)
    return y.sum()


def test_offload_layers_config_values():
    assert MemoryConfig().offload_layers == "auto"
    assert MemoryConfig(offload_layers="12").offload_layers == 12
    assert MemoryConfig(offload_layers=0).offload_layers == 0
    for bad in (-1, "half", 2.5, True):
        with pytest.raises(ValueError, match="offload_layers|number of layers|negative"):
            MemoryConfig(offload_layers=bad)
    with pytest.raises(ValueError, match="max_tensors"):
        OffloadActivations(max_tensors=-1)


@pytest.mark.parametrize(("asked", "host", "want"), [(1, None, 1), ("auto", 1 << 50, "all"), ("auto", 1, 0)])
def test_the_planner_applies_the_configured_split(asked, host, want, tokenizer, tmp_path):
    """The checkpointing transform reads memory.offload_layers (auto: decided on the host memory
    in the run's facts) and records the split with its reason in optimizations.json."""
    from hone.testing import tiny_config
    from hone.transforms.base import PlanContext, RunFacts
    from hone.transforms.checkpointing import CHECKPOINTING
    from hone.transforms.decide import decide

    cfg = tiny_config(
        tmp_path,
        memory={"activation_checkpointing": "offload", "offload_layers": asked},
        model={"preset_overrides": {"num_hidden_layers": LAYERS}},
    )
    facts = RunFacts(torch.device("cpu"), host_memory_bytes=host)
    model = _model(tokenizer, "full")
    details = CHECKPOINTING.model(model, PlanContext(cfg, facts, decide(cfg, facts)))
    assert details["offload"]["layers_offloaded"] == want
    assert "offload_layers" in details["offload"]["why"]
    assert offloader_for(model).max_tensors == (None if want == "all" else want)
