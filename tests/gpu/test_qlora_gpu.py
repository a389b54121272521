"""QLoRA on CUDA: hone's Triton NF4 dequantization at Qwen3-8B's shapes equals torchao's bit
for bit (and the CPU's), the 4-bit layer matches the bf16 layer of its dequantized weight, a
compiled (Inductor) QLoRA decoder layer has no graph break, and loading a quantized base never
holds the full-precision linear weights on the GPU. Skipped without a GPU."""

import pytest
import torch
from torch import nn

pytest.importorskip("torchao", reason="NF4 needs the optional 'quant' extra (torchao)")

from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4  # noqa: E402

from hone.kernels.nf4_dequant import nf4_dequantize_reference  # noqa: E402
from hone.kernels.nf4_dequant_triton import triton_available  # noqa: E402
from hone.models.nf4 import NF4Linear, nf4_components  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: Qwen3-8B's linear layers (out, in).
SHAPES = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_dequant_equals_torchao_bit_for_bit_at_real_shapes(shape, dtype):
    assert triton_available("cuda")
    gen = torch.Generator(device="cuda").manual_seed(shape[0] + shape[1])
    weight = (torch.randn(shape, device="cuda", generator=gen) * 0.02).to(dtype)
    nf4 = to_nf4(weight, 64, 256)
    layer = NF4Linear(shape[1], shape[0], *nf4_components(nf4))
    got = layer.dequantize()
    expected = nf4.get_original_weight()
    assert got.dtype == dtype and torch.equal(got, expected)
    # the kernel on the CPU reference's inputs: the same weight as the CPU reference
    assert torch.equal(nf4_dequantize_reference(*nf4_components(nf4), 64, 256, *shape), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantizing_on_cpu_gives_the_codes_of_the_gpu(shape, dtype):
    """``hone merge`` / ``generate`` rebuild a QLoRA base on the CPU (by default) that training
    quantized on the GPU; they match exactly when torchao's quantization is device-independent
    (the scale mean is a reduction: its rounding could in principle differ)."""
    gen = torch.Generator(device="cuda").manual_seed(shape[0] * 7 + shape[1])
    weight = (torch.randn(shape, device="cuda", generator=gen) * 0.02).to(dtype)
    gpu, cpu = to_nf4(weight, 64, 256), to_nf4(weight.cpu(), 64, 256)
    for got, expected in zip(nf4_components(cpu), nf4_components(gpu)):
        assert torch.equal(got.cuda(), expected)


@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_linear_matches_the_bf16_linear_of_its_dequantized_weight(shape):
    torch.manual_seed(0)
    linear = nn.Linear(shape[1], shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
    layer = NF4Linear.from_linear(linear, "cuda")
    reference = nn.Linear(shape[1], shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(layer.dequantize())
    x = torch.randn(2048, shape[1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, out_ref = layer(x), reference(x_ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    out_ref.backward(grad)
    torch.testing.assert_close(out, out_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-2, atol=1e-2)


def _qlora_model(tmp_path, layers=2):
    from hone.config import parse_config
    from hone.models.loader import load_model
    from hone.testing import tiny_tokenizer
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    cfg = parse_config(
        {
            "model": {
                "preset": "qwen3-8b",
                "preset_overrides": {"num_hidden_layers": layers},
                "dtype": "bfloat16",
                "quantize": "nf4",
            },
            "data": {"datasets": [{"path": "unused.jsonl", "type": "pretokenized"}], "sequence_len": 512},
            "adapter": {
                "type": "lora",
                "lora_r": 16,
                "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            },
            "training": {"output_dir": str(tmp_path)},
        }
    )
    facts = RunFacts(torch.device("cuda"))
    plan = plan_optimizations(cfg, facts)
    torch.cuda.reset_peak_memory_stats()
    loaded = load_model(cfg, tiny_tokenizer(), "cuda", before_adapter=lambda base: plan.apply(base, "base", cfg, facts))
    return loaded


def test_quantized_base_never_holds_the_bf16_linear_weights_on_the_gpu(tmp_path):
    loaded = _qlora_model(tmp_path)
    model = loaded.model
    peak = torch.cuda.max_memory_allocated()
    nf4_layers = [m for m in model.modules() if isinstance(m, NF4Linear)]
    assert len(nf4_layers) == 14
    bf16_linear = sum(m.in_features * m.out_features * 2 for m in nf4_layers)
    largest = max(m.in_features * m.out_features * 2 for m in nf4_layers)
    other = sum(p.numel() * p.element_size() for p in model.parameters())
    nf4 = sum(b.numel() * b.element_size() for m in nf4_layers for b in m.buffers())
    # everything that stays (embedding, head, norms, LoRA, 4-bit codes) plus one layer's transient
    # bf16 weight and its quantization scratch; far below the bf16 linear weights themselves
    assert peak < other + nf4 + 4 * largest + 2**26, (peak, other, nf4, bf16_linear)
    assert peak < other + bf16_linear


def test_compiled_qlora_layer_has_no_graph_break_and_matches_eager(tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _qlora_model(tmp_path, layers=1).model
    layer = model.get_base_model().model.layers[0]
    hidden = torch.randn(1, 256, 4096, device="cuda", dtype=torch.bfloat16)
    rotary = model.get_base_model().model.rotary_emb
    positions = torch.arange(256, device="cuda")[None]
    emb = rotary(hidden, positions)
    kwargs = {"position_embeddings": emb, "attention_mask": None, "position_ids": positions}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = layer(hidden, **kwargs)
        compiled = torch.compile(layer)(hidden, **kwargs)  # as hone compiles layers; breaks are counted
    eager = eager[0] if isinstance(eager, tuple) else eager
    compiled = compiled[0] if isinstance(compiled, tuple) else compiled
    assert sum(counters["graph_break"].values()) == 0
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()
