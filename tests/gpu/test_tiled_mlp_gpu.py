"""Tiled MLP on CUDA in bf16: a qwen3-style model at 8K tokens gives the untiled gradients
as closely as bf16 rounding allows (LoRA on every projection and full fine-tune, eager and under
Inductor with full checkpointing; judged against a float32 run, since Inductor's own bf16 fusions
put some gradients a few percent off the eager bf16 run with or without tiling), and without
checkpointing its peak memory is lower by about the MLP's [tokens x intermediate] activations. Skipped without a GPU.

Run: ``pytest -q -m gpu tests/gpu/test_tiled_mlp_gpu.py``
"""

import copy

import pytest
import torch

from hone.config.performance import PerformanceConfig
from hone.testing import loss_and_grads, norm_error, tiny_model, tiny_tokenizer, with_random_lora
from hone.transforms.checkpointing import apply_activation_checkpointing
from hone.transforms.compile import compile_regional
from hone.transforms.tiled_mlp import apply_tiled_mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

LAYERS, HIDDEN, INTERMEDIATE, SEQ = 4, 512, 2048, 8192
SHARDS = 8
BF16_TOL = 2e-2  # relative to each gradient's largest element (bf16 has 8 bits of mantissa)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _model(tok, adapter: str, dtype: torch.dtype = torch.bfloat16):
    model = tiny_model(
        "tiny-qwen3",
        tok,
        seed=41,
        num_hidden_layers=LAYERS,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=SEQ,
    )
    model.config._attn_implementation = "sdpa"
    if adapter == "lora":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(42)
            model = with_random_lora(model, seed=43)
    return model.to(device="cuda", dtype=dtype).train()


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(7, vocab, (1, SEQ), generator=torch.Generator().manual_seed(44)).cuda()


def _assert_close(got, untiled, float32):
    """``got`` as close to the float32 run as the untiled bf16 eager run is (twice its error plus
    1e-2 of slack, norm-relative): a wrong or doubled MLP shard's gradient is tens of percent off."""
    (loss, grads), (base_loss, base_grads), (ref_loss, ref_grads) = got, untiled, float32
    assert torch.isfinite(loss) and abs(loss - ref_loss) <= 2 * abs(base_loss - ref_loss) + BF16_TOL * abs(ref_loss)
    assert grads.keys() == ref_grads.keys() and any(".mlp." in n for n in ref_grads)
    for name, ref in ref_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        err, rounding = norm_error(grads[name], ref), norm_error(base_grads[name], ref)
        assert err <= 2 * rounding + 1e-2, f"{name}: {err:.2e} off float32 (untiled bf16: {rounding:.2e})"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor-full-checkpointing"])
@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_tiled_gradients_match_untiled_at_8k_in_bf16(tok, adapter, compiled):
    model = _model(tok, adapter)
    tiled = copy.deepcopy(model)
    apply_tiled_mlp(tiled, SHARDS)
    if compiled:
        apply_activation_checkpointing(tiled, "full")
        compile_regional(tiled, PerformanceConfig(torch_compile=True, torch_compile_backend="inductor"), dynamic=False)
    ids = _ids(len(tok))
    untiled = loss_and_grads(model, ids)
    float32 = loss_and_grads(_model(tok, adapter, torch.float32), ids)
    for _ in range(2 if compiled else 1):
        _assert_close(loss_and_grads(tiled, ids), untiled, float32)


def test_tiling_lowers_the_peak_by_the_mlp_activations(tok):
    """No checkpointing: every layer keeps its MLP's gate, up and activation ([SEQ x
    INTERMEDIATE] bf16 each) untiled, only the MLP's input tiled."""
    model = _model(tok, "lora")
    ids = _ids(len(tok))

    def peak(m) -> int:
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    untiled = peak(model)
    apply_tiled_mlp(model, SHARDS)
    tiled = peak(model)
    mlp_activations = LAYERS * 3 * SEQ * INTERMEDIATE * 2
    assert untiled - tiled >= 0.5 * mlp_activations, (untiled, tiled, mlp_activations)
