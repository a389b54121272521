"""``memory.offload_layers`` on CUDA: the first k layer inputs go to pinned host memory on side
streams, the others stay on the device; gradients equal those without checkpointing (fp32,
eager and regionally compiled), and the device holds exactly the kept inputs between the
forward and the backward. Skipped without a GPU."""

import pytest
import torch

from hone.config.performance import PerformanceConfig
from hone.testing import offload_step, sdpa_llama, tiny_tokenizer
from hone.transforms.checkpointing import apply_activation_checkpointing, offload_step_context, offloader_for
from hone.transforms.compile import compile_regional

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

LAYERS, HIDDEN, BATCH, SEQ = 6, 256, 2, 512


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _model(tok, adapter):
    return sdpa_llama(tok, adapter, seed=41, layers=LAYERS, hidden=HIDDEN, seq=SEQ).cuda().train()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("adapter", ["lora", "full"])
@pytest.mark.parametrize("offloaded", [2, 4])
def test_a_partial_offload_gives_the_gradients_of_none_on_cuda(offloaded, adapter, compiled, tok):
    ids = torch.randint(7, len(tok), (BATCH, SEQ), generator=torch.Generator().manual_seed(44)).cuda()
    reference = _model(tok, adapter)
    if compiled:
        compile_regional(reference, PerformanceConfig(torch_compile=True), dynamic=False)
    want = offload_step(reference, ids)[1]
    model = _model(tok, adapter)
    apply_activation_checkpointing(model, "offload", offload_layers=offloaded)
    if compiled:
        compile_regional(model, PerformanceConfig(torch_compile=True), dynamic=False)
    for _ in range(2):
        grads = offload_step(model, ids)[1]
        for name, ref in want.items():
            err = (grads[name] - ref).abs().max() / ref.abs().max()
            assert err <= (1e-4 if compiled else 1e-5), f"{name}: relative difference {err:.2e}"
    stats = offloader_for(model).stats
    assert stats.packed == offloaded and stats.shapes == [(BATCH, SEQ, HIDDEN)] * offloaded


def test_the_kept_inputs_stay_on_the_device(tok):
    """Between the forward and the backward the device holds the inputs that were not offloaded:
    offloading 2 of 6 frees 2 inputs' worth against full checkpointing, offloading all 6 frees 6."""

    def held(policy, layers=None):
        model = _model(tok, "full")
        apply_activation_checkpointing(model, policy, offload_layers=layers)
        ids = torch.randint(7, len(tok), (BATCH, SEQ), generator=torch.Generator().manual_seed(45)).cuda()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with offload_step_context(model):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            torch.cuda.synchronize()
            torch.empty(1, device="cuda")
            after = torch.cuda.memory_allocated()
            loss.backward()
        del model, loss
        return after - before

    layer_input = BATCH * SEQ * HIDDEN * 4
    full = held("full")
    two = held("offload", 2)
    every = held("offload", None)
    assert abs((full - two) - 2 * layer_input) <= 0.1 * layer_input, (full, two)
    assert abs((full - every) - LAYERS * layer_input) <= 0.1 * layer_input, (full, every)
