"""Checkpointing policies on CUDA: offload's side-stream path (pinned host copies, prefetch,
stream synchronisation) gives the gradients of ``none``, eager and under Inductor, and really
frees the layer inputs from device memory between the forward and the backward. Skipped without
a GPU."""

import contextlib

import pytest
import torch

from hone.config.performance import PerformanceConfig
from hone.testing import offload_step, sdpa_llama, tiny_tokenizer
from hone.transforms.checkpointing import (
    apply_activation_checkpointing,
    memory_budget_context,
    offload_step_context,
    offloader_for,
)
from hone.transforms.compile import compile_regional

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

LAYERS, HIDDEN, BATCH, SEQ = 4, 256, 2, 512


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _model(tok, adapter):
    return sdpa_llama(tok, adapter, seed=31, layers=LAYERS, hidden=HIDDEN, seq=SEQ).cuda().train()


def _ids(vocab):
    return torch.randint(7, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(34)).cuda()


def _assert_same(got, want, tol=1e-5):
    for name, ref in want.items():
        err = (got[name] - ref).abs().max() / ref.abs().max()
        assert err <= tol, f"{name}: relative difference {err:.2e}"


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("adapter", ["lora", "full"])
@pytest.mark.parametrize("policy", ["full", "selective", "offload"])
def test_policy_gives_the_gradients_of_none_on_cuda(policy, adapter, compiled, tok):
    """fp32. Compiled runs compare with the compiled ``none`` run: Inductor fuses (and so rounds)
    differently once checkpointing moves the recompute into the backward graph, hence 1e-4."""
    ids = _ids(len(tok))
    reference = _model(tok, adapter)
    if compiled:
        compile_regional(reference, PerformanceConfig(torch_compile=True), dynamic=False)
    want = offload_step(reference, ids)[1]
    model = _model(tok, adapter)
    budgeted = policy == "selective" and compiled  # under Inductor: the compiler's memory budget (planner)
    if not budgeted:
        apply_activation_checkpointing(model, policy)
    if compiled:
        compile_regional(model, PerformanceConfig(torch_compile=True), dynamic=False)
    for _ in range(2):  # the second step reuses the pinned host cache and the compiled graphs
        with memory_budget_context(0.3) if budgeted else contextlib.nullcontext():
            grads = offload_step(model, ids)[1]
        _assert_same(grads, want, tol=1e-4 if compiled else 1e-5)
    if policy == "offload":
        stats = offloader_for(model).stats
        moved = LAYERS - 1 if adapter == "lora" else LAYERS  # LoRA: layer 0's input is a leaf
        assert stats.packed == moved and stats.shapes == [(BATCH, SEQ, HIDDEN)] * moved
        assert stats.prefetched == moved - 1


def test_offload_holds_pinned_host_copies_and_frees_device_memory(tok):
    """Device memory held between the forward and the backward: offload holds the layer inputs
    less than full checkpointing (they are in pinned host memory instead)."""

    def held(policy):
        model = _model(tok, "full")
        apply_activation_checkpointing(model, policy)
        ids = _ids(len(tok))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with offload_step_context(model):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            torch.cuda.synchronize()
            torch.empty(1, device="cuda")  # lets the allocator retire blocks whose copies finished
            after = torch.cuda.memory_allocated()
            offloader = offloader_for(model)
            if offloader is not None:
                hosts = [s.host for s in offloader._saved]
                assert hosts and all(h.device.type == "cpu" and h.is_pinned() for h in hosts)
            loss.backward()
        del model, loss
        return after - before, offloader

    full_bytes, _ = held("full")
    offload_bytes, offloader = held("offload")
    layer_input = BATCH * SEQ * HIDDEN * 4
    assert offloader.stats.packed_bytes == LAYERS * layer_input
    assert full_bytes - offload_bytes >= 0.9 * LAYERS * layer_input, (full_bytes, offload_bytes)


def test_offload_without_side_streams_gives_the_same_gradients(tok):
    ids = _ids(len(tok))
    want = offload_step(_model(tok, "full"), ids)[1]
    model = _model(tok, "full")
    apply_activation_checkpointing(model, "offload", use_streams=False)
    _assert_same(offload_step(model, ids)[1], want)
    assert offloader_for(model).stats.packed == LAYERS
