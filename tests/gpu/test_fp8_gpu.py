"""Float8 on a CUDA GPU of compute capability >= 8.9 (H100): the frozen-base LoRA layer at an 8B
model's projection shape against the dequantized reference and against bf16 (output, input
gradient, LoRA gradients); compiled LoRA training through ``run_training`` with 0 graph breaks
and 0 recompiles, tracking bf16; torchao's full fine-tune, eager and compiled, tracking bf16;
on 2 GPUs, FSDP2 full fine-tuning with float8 all-gather (tensorwise) and DDP with a float8
LoRA base, each tracking the same run in bf16.

Run: pytest -q -m gpu tests/gpu/test_fp8_gpu.py (the 2-GPU tests skip on one GPU).

Tolerances: against the dequantized reference (same float8 operands, float32 matmul) only
accumulation order and the final bf16 rounding differ: rtol 1.6e-2 (2 bf16 ulps), and the
relative error in norm < 1e-2. Against bf16, float8 e4m3 rounds each operand to 3 mantissa
bits: relative error in norm < 8% per matmul; losses of a few training steps within 3%.
"""

import json
import os
import random
import socket

import pytest
import torch
from rich.console import Console

from hone.config import parse_config
from hone.kernels.fp8_linear import fp8_linear_reference, quantize_frozen_weight
from hone.testing import OneProjection

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with float8 (>= 8.9)",
    ),
    pytest.mark.usefixtures("fresh_dynamo"),
]

FP8_REL_TOL = 0.08


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---------------------------------------------------------------- the frozen-base LoRA layer


@pytest.mark.parametrize("mode", ["rowwise", "tensorwise"])
def test_lora_layer_on_float8_base_matches_the_dequantized_reference_and_bf16(mode):
    from peft import LoraConfig, get_peft_model

    from hone.transforms.fp8 import Fp8FrozenLinear

    torch.manual_seed(0)
    tokens, k, n, r = 4096, 4096, 14_336, 16  # llama3-8b's up_proj, seq 4096
    base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    base.weight.data.normal_(0, 0.02)
    lora = get_peft_model(OneProjection(base), LoraConfig(r=r, lora_alpha=32, target_modules=["proj"])).base_model.model.proj.to(
        "cuda"
    )
    for p in (lora.lora_A["default"].weight, lora.lora_B["default"].weight):
        p.data.normal_(0, 0.02)  # B random: zero B makes A's gradient zero
    x = torch.randn(2, tokens // 2, k, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(2, tokens // 2, n, device="cuda", dtype=torch.bfloat16)

    def run(forward):
        xi = x.clone().requires_grad_()
        lora.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = forward(xi)
        y.backward(grad)
        return {
            "y": y.detach(),
            "dx": xi.grad,
            **{name: p.grad.clone() for name, p in lora.named_parameters() if p.requires_grad},
        }

    def lora_path(xi):
        a, b = lora.lora_A["default"], lora.lora_B["default"]
        return b(a(xi)) * lora.scaling["default"]

    bf16 = run(lora)
    fp8_weight = quantize_frozen_weight(base.weight, mode)
    reference = run(lambda xi: fp8_linear_reference(xi, fp8_weight) + lora_path(xi))
    lora.base_layer = Fp8FrozenLinear(base, mode)
    got = run(lora)
    assert set(got) == {"y", "dx", "lora_A.default.weight", "lora_B.default.weight"}
    for name in got:
        assert _rel(got[name], reference[name]) < 1e-2, name
        assert _rel(got[name], bf16[name]) < FP8_REL_TOL, name
    # The forward accumulates with Hopper's fast float8 accumulation, the float32 reference does
    # not: on the H100 a handful of the 58M outputs differ by up to 0.023 (1.5 bf16 steps of a
    # value near 4), hence the absolute tolerance; the norm-relative check above stays at 1e-2.
    torch.testing.assert_close(got["y"], reference["y"], rtol=1.6e-2, atol=4e-2)
    assert lora.base_layer.weight.grad is None


# ---------------------------------------------------------------- training through hone


def _train(tmp_path, name, adapter, performance, layers=4, steps=8, checkpointing="none", distributed=None):
    rng = random.Random(0)
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"input_ids": [rng.randint(5, 250) for _ in range(128)]}) + "\n" for _ in range(64)))
    cfg = parse_config(
        {
            "model": {
                "preset": "tiny-qwen3",
                "dtype": "bfloat16",
                "preset_overrides": {"num_hidden_layers": layers, "hidden_size": 256, "intermediate_size": 768},
            },
            "data": {
                "datasets": [{"path": str(data), "type": "pretokenized"}],
                "sequence_len": 128,
                "dataset_prepared_path": str(tmp_path / "cache"),
            },
            "adapter": adapter,
            "training": {"max_steps": steps, "micro_batch_size": 4, "output_dir": str(tmp_path / name), "seed": 3},
            "optimizer": {"learning_rate": 1e-3, "lr_scheduler": "constant"},
            "memory": {"activation_checkpointing": checkpointing},
            "distributed": distributed or {},
            "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
            "performance": performance,
        }
    )
    from hone.train.run import run_training

    losses = []
    torch._dynamo.utils.counters.clear()
    run_training(cfg, device="cuda", console=Console(quiet=True), step_callback=lambda m: losses.append(m.loss))
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    record = json.loads((tmp_path / name / "optimizations.json").read_text())
    return losses, record, breaks


LORA = {"type": "lora", "lora_r": 8, "lora_target_modules": "all-linear"}


@pytest.mark.parametrize("mode", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_compiled_fp8_lora_training_has_no_graph_break_and_tracks_bf16(tmp_path, mode, checkpointing):
    perf = {"torch_compile": True}
    bf16, _, _ = _train(tmp_path, "bf16", LORA, perf, checkpointing=checkpointing)
    fp8, record, breaks = _train(tmp_path, "fp8", LORA, {**perf, "fp8": mode}, checkpointing=checkpointing)
    applied = {a["name"]: a["details"] for a in record["applied"]}
    assert applied["fp8"]["converted"] == 4 * 7 and applied["fp8"]["mode"] == mode
    names = [a["name"] for a in record["applied"]]
    assert names.index("fp8") < names.index("compile")
    assert breaks == 0
    stats = record["compile"]
    assert stats["forward_graphs"] == 1 and stats["recompiles"] == 0 and stats["compiles_after_first_step"] == 0, stats
    assert all(abs(a - b) / b < 0.03 for a, b in zip(fp8, bf16, strict=True)), (fp8, bf16)


def test_fp8_auto_on_attention_lora_converts_every_frozen_linear_under_cuda_graphs_and_tracks_bf16(tmp_path):
    """The defaults around ``fp8: auto`` on rows of one length: CUDA graphs on (a float8 LoRA base
    is host-bound without them), so ``fp8_base_linears: auto`` converts every frozen linear, not
    only the LoRA targets; the losses follow bf16's (benchmarks/2026-11-29-h200-fp8.md: 94.5 ms)."""
    attention = {"type": "lora", "lora_r": 8, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    bf16, _, _ = _train(tmp_path, "bf16", attention, {})
    fp8, record, breaks = _train(tmp_path, "fp8", attention, {"fp8": "auto"})
    applied = {a["name"]: a["details"] for a in record["applied"]}
    assert applied["fp8"]["converted"] == 4 * 7 and applied["fp8"]["mode"] == "tensorwise"
    assert applied["compile"]["cuda_graphs"] is True and breaks == 0
    assert record["decided"]["fp8_base_linears"] == "all"
    assert all(abs(a - b) / b < 0.03 for a, b in zip(fp8, bf16, strict=True)), (fp8, bf16)


@pytest.mark.parametrize("compile_", [False, True])
@pytest.mark.parametrize("mode", ["rowwise", "tensorwise"])
def test_full_finetune_float8_trains_like_bf16(tmp_path, mode, compile_):
    perf = {"torch_compile": compile_}
    bf16, _, _ = _train(tmp_path, "bf16", {"type": "none"}, perf)
    fp8, record, breaks = _train(tmp_path, "fp8", {"type": "none"}, {**perf, "fp8": mode})
    applied = {a["name"]: a["details"] for a in record["applied"]}
    assert applied["fp8"]["converted"] == 4 * 7 and applied["fp8"]["kept_high_precision"] == 1  # the head
    if compile_:
        assert breaks == 0 and record["compile"]["recompiles"] == 0, record["compile"]
    assert all(abs(a - b) / b < 0.03 for a, b in zip(fp8, bf16, strict=True)), (fp8, bf16)


# ---------------------------------------------------------------- FSDP2, float8 all-gather


def _worker(rank: int, port: int, tmp_path, name: str, adapter: dict, performance: dict, strategy: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2"
    )
    torch.cuda.set_device(rank)
    perf = {"torch_compile": True, **performance}
    losses, record, _ = _train(tmp_path, name, adapter, perf, checkpointing="full", distributed={"strategy": strategy})
    if rank == 0:
        (tmp_path / f"{name}.json").write_text(json.dumps({"losses": losses, "record": record}))


def _two_gpus(tmp_path, name, performance, adapter=None, strategy="fsdp"):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = (port, tmp_path, name, adapter or {"type": "none"}, performance, strategy)
    mp.spawn(_worker, args=args, nprocs=2, join=True)
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_the_once_a_step_shard_cast_is_bitwise_torchaos_cast():
    """FSDP2's float8 all-gather casts every shard once per step (hone.transforms.fp8_cast_once);
    on the GPU the bits must be those torchao's own cast gives in the pre-all-gather hook, at
    llama3.2-3b's shard shapes and an odd one, saturated values included."""
    from torchao.float8.float8_scaling_utils import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    from hone.transforms.fp8_cast_once import cast_all

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1536, 3072), (512, 3072), (4096, 3072), (1536, 8192), (1000, 8)]
    shards = [(torch.randn(shape, device="cuda", generator=g) * 2).to(torch.bfloat16) for shape in shapes]
    scales = torch.stack([448.0 / s.float().abs().max() * 2 for s in shards])  # the top values saturate
    got = cast_all(shards, scales, torch.float8_e4m3fn)
    for shape, shard, scale, bits in zip(shapes, shards, scales, got, strict=True):
        want = hp_tensor_and_scale_to_float8(shard, scale, torch.float8_e4m3fn, LinearMMConfig(), GemmInputRole.WEIGHT)._data
        assert torch.equal(bits.view(torch.uint8), want.view(torch.uint8)), shape


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_the_float8_head_loss_matches_its_reference_at_llama3_8b_head_shape(impl):
    """The fused loss through a frozen float8 head (performance.fp8_head) at llama3-8b's head
    (128,256 x 4096) over 2,048 bf16 tokens, two chunks: loss and hidden-state gradient against
    the same quantization on dequantized operands in float32, and near the bf16 head's."""
    from hone.kernels import linear_cross_entropy_reference
    from hone.kernels.cross_entropy_fp8 import fused_linear_cross_entropy_fp8, linear_cross_entropy_fp8_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    vocab, hidden_size, tokens = 128_256, 4096, 2048
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    targets[:100] = -100
    head = quantize_frozen_weight(weight, "rowwise")

    def value_and_grad(fn, *args, **kwargs):
        h = hidden.clone().requires_grad_(True)
        loss = fn(h, *args, **kwargs)
        (loss / tokens).backward()
        return loss.detach(), h.grad

    loss, grad = value_and_grad(fused_linear_cross_entropy_fp8, head, targets, chunk_tokens=1024, impl=impl)
    want_loss, want_grad = value_and_grad(linear_cross_entropy_fp8_reference, head, targets)
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=0.0)
    assert _rel(grad, want_grad) < 1e-2
    bf16_loss, bf16_grad = value_and_grad(linear_cross_entropy_reference, weight, targets)
    torch.testing.assert_close(loss, bf16_loss, rtol=1e-2, atol=0.0)
    assert _rel(grad, bf16_grad) < FP8_REL_TOL


def test_the_compiled_row_quantization_of_the_float8_head_is_the_eager_one():
    """The float8 head quantizes each chunk's [chunk x vocab] logit gradient with an Inductor-
    compiled rowwise quantization (hone.kernels.cross_entropy_fp8): the scales must be the eager
    ones and the float8 values too, but for a rare value a compiled division rounds the other way."""
    from hone.kernels.cross_entropy_fp8 import _quantize_rows
    from hone.kernels.fp8_linear import quantize

    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in (1024, 1000):  # a full chunk, then a ragged one (one graph: dynamic shapes)
        grad = (torch.randn(rows, 128_256, device="cuda", generator=g) * 1e-4).to(torch.bfloat16)
        got_q, got_scale = _quantize_rows(grad)
        want_q, want_scale = quantize(grad, "rowwise")
        torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0.0)
        differ = got_q.view(torch.uint8) != want_q.view(torch.uint8)
        assert differ.float().mean().item() < 1e-4, differ.float().mean().item()
        step = want_q.float().abs() * 0.13 + 2.0**-9  # one float8 step (e4m3: 3 mantissa bits; 2^-9 the least subnormal)
        assert ((got_q.float() - want_q.float()).abs() <= step).all()


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA devices")


@two_gpus
@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_fsdp2_float8_full_finetune_tracks_fsdp2_bf16(tmp_path, mode):
    """2 ranks, FSDP2, compile and full checkpointing: float8 (tensorwise: weights all-gathered
    in float8, scales computed after each optimizer step) against the same run in bf16."""
    bf16 = _two_gpus(tmp_path, "fsdp-bf16", {})
    fp8 = _two_gpus(tmp_path, f"fsdp-{mode}", {"fp8": mode})
    applied = {a["name"]: a["details"] for a in fp8["record"]["applied"]}
    assert "fsdp" in applied, list(applied)
    assert applied["fp8"]["fsdp_float8_all_gather"] == (mode == "tensorwise")
    assert all(abs(a - b) / b < 0.03 for a, b in zip(fp8["losses"], bf16["losses"], strict=True)), (fp8["losses"], bf16["losses"])


@two_gpus
def test_ddp_float8_lora_tracks_ddp_bf16(tmp_path):
    """2 ranks, DDP (the float8 copies are broadcast once when DDP wraps the model), compile and
    full checkpointing: LoRA on a float8 base against the same run on a bf16 base."""
    bf16 = _two_gpus(tmp_path, "ddp-bf16", {}, LORA, "ddp")
    fp8 = _two_gpus(tmp_path, "ddp-fp8", {"fp8": "rowwise"}, LORA, "ddp")
    applied = {a["name"]: a["details"] for a in fp8["record"]["applied"]}
    assert "ddp" in applied and applied["fp8"]["converted"] == 4 * 7
    assert all(abs(a - b) / b < 0.03 for a, b in zip(fp8["losses"], bf16["losses"], strict=True)), (fp8["losses"], bf16["losses"])
