"""Tiled decoder layers on CUDA in bf16, at a qwen3-8b layer's width (hidden 4096, 32 query heads,
8 key/value heads of 128, MLP 12288; 2 layers) and 8K tokens in 4 chunks: the gradients are as
close to a float32 run as the untiled checkpointed bf16 run's are (LoRA on every projection and
full fine-tune, eager; LoRA under Inductor), and the backward's peak memory is lower than the
untiled checkpointed layer's (the layer rebuilt in the backward holds a quarter of the tokens'
activations). The chunk attention runs torch's flash kernel with the lower-right causal mask and
GQA. Skipped without a GPU.

Run: ``pytest -q -m gpu tests/gpu/test_tiled_layers_gpu.py``
"""

import pytest
import torch

from hone.config.performance import PerformanceConfig
from hone.models.attention.causal import register_causal_sdpa
from hone.testing import loss_and_grads, norm_error, tiny_model, tiny_tokenizer, with_random_lora
from hone.transforms.checkpointing import apply_activation_checkpointing
from hone.transforms.compile import compile_regional
from hone.transforms.tiled_layers import apply_tiled_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, SEQ = 2, 4096, 12288, 32, 8, 128, 8192
CHUNKS = 4


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _model(tok, adapter: str, dtype: torch.dtype = torch.bfloat16):
    model = tiny_model(
        "tiny-qwen3",
        tok,
        seed=51,
        num_hidden_layers=LAYERS,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=SEQ,
    )
    model.set_attn_implementation(register_causal_sdpa())
    if adapter == "lora":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(52)
            model = with_random_lora(model, seed=53)
    model = model.to(device="cuda", dtype=dtype).train()
    apply_activation_checkpointing(model, "full", use_streams=False)
    return model


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(7, vocab, (1, SEQ), generator=torch.Generator().manual_seed(54)).cuda()


def _assert_close(got, untiled, float32):
    """``got`` as close to the float32 run as the untiled bf16 run is (twice its error plus 1e-2
    of slack, norm-relative): a chunk attending to the wrong keys, or a key gradient lost between
    chunks, is tens of percent off."""
    (loss, grads), (base_loss, base_grads), (ref_loss, ref_grads) = got, untiled, float32
    assert torch.isfinite(loss) and abs(loss - ref_loss) <= 2 * abs(base_loss - ref_loss) + 2e-2 * abs(ref_loss)
    assert grads.keys() == ref_grads.keys() and any("k_proj" in n for n in ref_grads)
    for name, ref in ref_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        err, rounding = norm_error(grads[name], ref), norm_error(base_grads[name], ref)
        assert err <= 2 * rounding + 1e-2, f"{name}: {err:.2e} off float32 (untiled bf16: {rounding:.2e})"


@pytest.mark.parametrize(
    ("adapter", "compiled"), [("lora", False), ("full", False), ("lora", True)], ids=["lora-eager", "full-eager", "lora-inductor"]
)
def test_tiled_gradients_match_untiled_at_8k_in_bf16(tok, adapter, compiled):
    ids = _ids(len(tok))
    float32 = loss_and_grads(_model(tok, adapter, torch.float32), ids)
    torch.cuda.empty_cache()
    model = _model(tok, adapter)
    untiled = loss_and_grads(model, ids)
    apply_tiled_layers(model, CHUNKS)
    if compiled:
        compile_regional(model, PerformanceConfig(torch_compile=True, torch_compile_backend="inductor"), dynamic=False)
    for _ in range(2 if compiled else 1):
        _assert_close(loss_and_grads(model, ids), untiled, float32)


def test_the_tiled_backward_peaks_lower_than_the_untiled_checkpointed_one(tok):
    """Both keep only the layers' inputs between the forward and the backward; the backward
    rebuilds one layer at a time, the tiled one a quarter of its tokens at a time."""
    model = _model(tok, "lora")
    ids = _ids(len(tok))

    def backward_peak(m) -> int:
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    untiled = backward_peak(model)
    apply_tiled_layers(model, CHUNKS)
    tiled = backward_peak(model)
    print(
        f"backward peak above the forward's: untiled {untiled / 2**20:.0f} MiB, tiled in {CHUNKS} chunks {tiled / 2**20:.0f} MiB"
    )
    assert tiled < 0.7 * untiled, (untiled, tiled)
