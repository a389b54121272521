"""The memory estimate: its per-layer activation formula against what autograd really saves
(counted with saved_tensors_hooks on tiny models), and its peak against measured GPU peaks."""

from typing import Any

import pytest
import torch

from hone.config import parse_config
from hone.models.loader import load_model
from hone.models.tokenizer import load_tokenizer
from hone.transforms.memory.estimate import estimate_memory
from hone.transforms.memory.facts import model_facts
from hone.transforms.memory.knobs import Knobs
from hone.transforms.memory.layers import layer_bytes
from hone.transforms.memory.longest import longest_sequence
from hone.transforms.memory.terms.loss import fused_chunk_tokens
from hone.units import GIB

QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL7 = [*QKVO, "gate_proj", "up_proj", "down_proj"]
TOKENS = 64


def _cfg(
    preset: str,
    dtype: str = "bfloat16",
    adapter: Any = None,
    seq: int = 2048,
    mbs: int = 1,
    attention: str = "sdpa",
    **extra: Any,
):
    model = {"preset": preset, "dtype": dtype, "attn_implementation": attention}
    if preset.startswith("tiny"):
        model["preset_overrides"] = {"num_hidden_layers": 3}
    raw = {
        "model": model,
        "data": {"datasets": [{"path": "unused.jsonl", "type": "pretokenized"}], "sequence_len": seq},
        "adapter": adapter
        if adapter is not None
        else {"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": QKVO},
        "training": {"micro_batch_size": mbs},
    }
    for key, value in extra.items():
        section, name = key.split("__")
        raw.setdefault(section, {})[name] = value
    return parse_config(raw)


def _saved_bytes_of_layer(cfg, layer_index: int = 1, compile_layers: bool = False, prepare=None) -> int:
    """Bytes autograd saves inside decoder layer ``layer_index`` for one forward of TOKENS
    random tokens, deduplicated by storage, parameters excluded (they are weights, not
    activations). A middle layer: the first one's input does not require grad. ``prepare(model)``
    changes the loaded model first (a transform's conversion)."""
    torch.manual_seed(0)
    loaded = load_model(cfg, load_tokenizer(cfg.model), "cpu")
    model = loaded.model
    if prepare is not None:
        prepare(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layers = next(m for n, m in model.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList))
    if compile_layers:
        for layer in layers:
            layer.compile(backend="aot_eager_decomp_partition")
    current = [None]
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda mod, args, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda mod, args, out: current.__setitem__(0, None))
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if current[0] == layer_index and ptr not in params and ptr not in seen:
            seen.add(ptr)
            total[0] += storage.nbytes()
        return t

    ids = torch.randint(1, 200, (1, TOKENS))
    autocast = loaded.autocast_dtype

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            return model(input_ids=ids, use_cache=False).logits

    if compile_layers:  # compile outside the hooks, then count a second forward
        forward().float().sum().backward()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return total[0]


def _formula(cfg, compiled: bool = False, float8: tuple[str, str] | None = None) -> int:
    facts = model_facts(cfg)
    est = layer_bytes(
        facts.layers[1], facts, compiled=compiled, attention=cfg.model.attn_implementation, device="cpu", float8=float8
    )
    return est.at(TOKENS, TOKENS)


CASES = {
    "llama fp32 full": ("tiny-llama", "float32", {"type": "none"}, "sdpa"),
    "llama fp32 lora all-linear dropout": (
        "tiny-llama",
        "float32",
        {"type": "lora", "lora_target_modules": "all-linear", "lora_dropout": 0.1},
        "sdpa",
    ),
    "llama bf16 full": ("tiny-llama", "bfloat16", {"type": "none"}, "sdpa"),
    "llama bf16 lora all 7": ("tiny-llama", "bfloat16", {"type": "lora", "lora_target_modules": ALL7}, "sdpa"),
    "llama bf16 lora q,v dropout": (
        "tiny-llama",
        "bfloat16",
        {"type": "lora", "lora_target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1},
        "sdpa",
    ),
    "llama fp32 lora eager attention": ("tiny-llama", "float32", {"type": "lora"}, "eager"),
    "qwen3 fp32 lora q,k,v,o": ("tiny-qwen3", "float32", {"type": "lora", "lora_target_modules": QKVO}, "sdpa"),
    "qwen3 bf16 lora q,k,v,o": ("tiny-qwen3", "bfloat16", {"type": "lora", "lora_target_modules": QKVO}, "sdpa"),
    "qwen3 fp32 full": ("tiny-qwen3", "float32", {"type": "none"}, "sdpa"),
    "qwen3-moe fp32 lora q,k,v,o": ("tiny-qwen3-moe", "float32", {"type": "lora", "lora_target_modules": QKVO}, "sdpa"),
    "qwen3-moe bf16 lora q,k,v,o": ("tiny-qwen3-moe", "bfloat16", {"type": "lora", "lora_target_modules": QKVO}, "sdpa"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_formula_matches_what_autograd_saves(case):
    preset, dtype, adapter, attention = CASES[case]
    cfg = _cfg(preset, dtype, adapter, attention=attention)
    counted = _saved_bytes_of_layer(cfg)
    assert _formula(cfg) == pytest.approx(counted, rel=0.10), f"{case}: formula {_formula(cfg)} vs saved {counted}"


def test_compiled_layer_formula_matches_the_partitioners_choice():
    """Inductor's min-cut partitioner (here without code generation) keeps fewer tensors."""
    cfg = _cfg("tiny-qwen3", "bfloat16", {"type": "lora", "lora_target_modules": QKVO})
    counted = _saved_bytes_of_layer(cfg, compile_layers=True)
    assert _formula(cfg, compiled=True) == pytest.approx(counted, rel=0.10)
    assert counted < _formula(cfg, compiled=False)


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_compiled_float8_full_finetune_layer_formula_matches_the_partitioners_choice(mode):
    """torchao's Float8Linear saves its bf16 input; compiled, the partitioner recomputes the float8
    casts from what the layer keeps anyway and saves only the output projection's input, in float8
    (hone.transforms.memory.terms.fp8.float8_site_bytes). Emulated float8: the same casts and
    scales, so the same saved tensors, on any CPU."""
    from hone.transforms.fp8 import convert_full_finetune

    cfg = _cfg("tiny-llama", "bfloat16", {"type": "none"})
    counted = _saved_bytes_of_layer(
        cfg, compile_layers=True, prepare=lambda model: convert_full_finetune(model, mode, emulate=True)
    )
    formula = _formula(cfg, compiled=True, float8=(mode, "fp8"))
    assert formula == pytest.approx(counted, rel=0.10)
    bf16 = _saved_bytes_of_layer(cfg, compile_layers=True)
    assert counted < 0.8 * bf16 and formula < 0.8 * _formula(cfg, compiled=True)  # the projections' inputs are gone
    # eager, torchao saves the bf16 input as a bf16 layer does: the rule is for compiled layers only
    assert _formula(cfg, compiled=False, float8=(mode, "fp8")) == _formula(cfg, compiled=False)


# torch.cuda.max_memory_allocated of hone bench rows on an H100, llama3.2-3b full fine-tune, seq 4096
# mbs 2, compiled, no checkpointing, fused loss (benchmarks/2026-11-26-h100-quantization.md, session 8):
# (performance.fp8, fp8_small_linears, measured GiB)
MEASURED_FP8_FULL = [
    ("off", "fp8", 41.2),
    ("tensorwise", "fp8", 35.1),
    ("tensorwise", "bf16", 37.1),
    ("rowwise", "bf16", 37.1),
]


@pytest.mark.parametrize("row", MEASURED_FP8_FULL, ids=lambda r: f"fp8-{r[0]}-small-{r[1]}")
def test_float8_full_finetune_estimate_within_five_percent_of_measured_peaks(row):
    """Before the compiled float8 rule the float8 rows were estimated as the bf16 one (40.4 GiB, +15%)."""
    fp8, small, measured = row
    extra = {} if fp8 == "off" else {"performance__fp8": fp8, "performance__fp8_small_linears": small}
    cfg = _cfg("llama3.2-3b", adapter={"type": "none"}, seq=4096, mbs=2, **extra)
    est = estimate_memory(cfg, Knobs(checkpointing="none", loss="fused_linear_ce", compiled=True))
    assert est.total / GIB == pytest.approx(measured, rel=0.05)


def test_float8_auto_full_finetune_is_estimated_as_the_scaling_it_takes():
    """One process and weights sharded by FSDP2: tensorwise (hone.transforms.fp8_sizes.fp8_scaling).
    qwen3-30b-a3b's q_proj (2048 -> 4096) is narrow for rowwise only, so the two estimates differ."""

    def total(fp8, shards=1):
        extra = {"performance__fp8": fp8, "performance__fp8_small_linears": "bf16"}
        cfg = _cfg("qwen3-30b-a3b", adapter={"type": "none"}, seq=4096, mbs=2, **extra)
        return estimate_memory(cfg, Knobs(checkpointing="none", loss="fused_linear_ce", compiled=True, param_shards=shards)).total

    assert total("auto") == total("tensorwise") != total("rowwise")
    assert total("auto", shards=2) == total("tensorwise", shards=2) != total("rowwise", shards=2)


# torch.cuda.max_memory_allocated of hone bench rows on an H100 (BENCHMARKS.md, issue 11):
# (preset, sequence_len, micro_batch, targets, checkpointing, compiled, measured GiB), standard loss
MEASURED = [
    ("qwen3-8b", 2048, 1, QKVO, "none", True, 27.4),
    ("qwen3-8b", 2048, 1, QKVO, "none", False, 32.0),  # eager (H200, 2026-11-26 compile table)
    ("qwen3-8b", 2048, 1, QKVO, "full", True, 20.1),
    ("qwen3-8b", 16384, 1, QKVO, "full", True, 52.7),
    ("qwen3-8b", 24576, 1, QKVO, "full", True, 71.3),
    ("llama3-8b", 4096, 2, ALL7, "full", True, 31.3),
    ("llama3-8b", 4096, 2, ALL7, "none", True, 65.5),
]


@pytest.mark.parametrize("row", MEASURED, ids=lambda r: f"{r[0]}-{r[1]}x{r[2]}-{r[4]}-{'compiled' if r[5] else 'eager'}")
def test_estimate_within_ten_percent_of_measured_peaks(row):
    preset, seq, mbs, targets, policy, compiled, measured = row
    cfg = _cfg(preset, adapter={"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": targets}, seq=seq, mbs=mbs)
    est = estimate_memory(cfg, Knobs(checkpointing=policy, loss="standard", compiled=compiled))
    assert est.total / GIB == pytest.approx(measured, rel=0.10)
    assert sum(b for _, b in est.components()) == est.total


# The same with the fused linear cross-entropy (the default loss), regional compile, H100,
# 2026-11-26 (benchmarks/2026-11-26-h100-seam.md): every checkpointing policy hone runs there.
MEASURED_FUSED = [
    ("qwen3-8b", 2048, 1, QKVO, "none", 23.57),
    ("qwen3-8b", 2048, 1, QKVO, "full", 16.37),
    ("qwen3-8b", 2048, 1, QKVO, "offload", 15.90),
    ("qwen3-8b", 24576, 1, QKVO, "full", 26.00),
    ("qwen3-8b", 24576, 1, QKVO, "offload", 19.80),
    ("llama3-8b", 4096, 2, ALL7, "full", 19.70),
    ("llama3-8b", 4096, 2, ALL7, "offload", 18.04),
]


@pytest.mark.parametrize("row", MEASURED_FUSED, ids=lambda r: f"{r[0]}-{r[1]}x{r[2]}-{r[4]}-fused")
def test_fused_loss_estimate_within_ten_percent_of_measured_peaks(row):
    preset, seq, mbs, targets, policy, measured = row
    cfg = _cfg(preset, adapter={"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": targets}, seq=seq, mbs=mbs)
    est = estimate_memory(cfg, Knobs(checkpointing=policy, loss="fused_linear_ce", compiled=True))
    assert est.total / GIB == pytest.approx(measured, rel=0.10)


def test_parameter_counts_are_exact():
    facts = model_facts(_cfg("qwen3-8b"))
    per_layer = 16 * (4096 + 4096) * 2 + 16 * (4096 + 1024) * 2  # q, o + k, v
    assert facts.trainable_params == 36 * per_layer
    assert facts.trainable_bytes == 4 * facts.trainable_params  # LoRA weights are float32
    assert facts.frozen_bytes == 2 * facts.frozen_params
    assert 8.1e9 < facts.frozen_params < 8.3e9


def test_full_finetune_counts_gradients_and_optimizer_in_the_weight_dtype():
    cfg = _cfg("qwen3-8b", adapter={"type": "none"})
    est = estimate_memory(cfg, Knobs(checkpointing="full", loss="standard"))
    facts = model_facts(cfg)
    assert facts.frozen_params == 0
    assert est.optimizer == 2 * 2 * facts.trainable_params  # two bf16 moments
    assert est.phase in ("backward, first layer", "optimizer step")
    assert est.trainable_state == 2 * facts.trainable_params


@pytest.mark.parametrize(("name", "per_weight"), [("adamw_8bit", 2 * (1 + 4 / 256)), ("adamw_4bit", 2 * (0.5 + 4 / 128))])
def test_low_bit_adamw_counts_its_quantized_moments(name, per_weight):
    full = _cfg("qwen3-8b", adapter={"type": "none"})
    low = _cfg("qwen3-8b", adapter={"type": "none"}, optimizer__name=name)
    knobs = Knobs(checkpointing="full", loss="standard")
    est_full, est_low = estimate_memory(full, knobs), estimate_memory(low, knobs)
    params = model_facts(low).trainable_params
    assert est_low.optimizer == round(per_weight * params)  # two bf16 moments were 4 bytes a weight
    saved = est_full.optimizer - est_low.optimizer - est_low.optimizer_step  # the step's temporaries take some back
    assert est_full.total - est_low.total >= saved > 0  # (the workspace allowance scales)
    assert est_low.weights == est_full.weights and est_low.trainable_state == est_full.trainable_state


def test_policies_order_and_offload_uses_the_host():
    cfg = _cfg("qwen3-8b", seq=8192)
    est = {p: estimate_memory(cfg, Knobs(checkpointing=p, loss="standard")) for p in ("none", "selective", "full", "offload")}
    assert est["none"].total > est["selective"].total > est["full"].total > est["offload"].total
    # layer 0's input is a leaf under LoRA (autograd keeps it): the other 35 go to the host
    assert est["offload"].host == 35 * 2 * 8192 * 4096 and est["offload"].offloaded_layers == 35
    assert all(est[p].host == 0 for p in ("none", "selective", "full"))


def test_fused_loss_holds_one_chunk():
    cfg = _cfg("qwen3-8b", seq=16384)
    standard = estimate_memory(cfg, Knobs(checkpointing="full", loss="standard"))
    fused = estimate_memory(cfg, Knobs(checkpointing="full", loss="fused_linear_ce"))
    assert fused.loss < standard.loss / 8
    from hone.kernels.cross_entropy import default_chunk_tokens

    for tokens, vocab in ((16384, 151_936), (100, 151_936), (1 << 20, 1 << 20)):
        assert fused_chunk_tokens(tokens, vocab) == default_chunk_tokens(tokens, vocab)  # the kernel's own chunk
    chunk = fused_chunk_tokens(16384, 151_936)
    from hone.transforms.memory.terms.loss import loss_bytes

    facts = model_facts(cfg)
    on_cuda, on_cpu = (loss_bytes(facts, 16384, "fused_linear_ce", device) for device in ("cuda", "cpu"))
    assert on_cpu - on_cuda == chunk * 151_936 * (2 + 4)  # the torch step's float32 copy and downcast gradient


def test_gradient_accumulation_keeps_gradients_through_the_loss():
    one = estimate_memory(_cfg("qwen3-8b"), Knobs(checkpointing="none", loss="standard"))
    accumulating = estimate_memory(
        _cfg("qwen3-8b", training__gradient_accumulation_steps=4), Knobs(checkpointing="none", loss="standard")
    )
    assert accumulating.trainable_state > one.trainable_state == 0


def test_longest_sequence_is_the_largest_that_fits():
    from hone.transforms.memory.decide import AUTO_MARGIN

    cfg = _cfg("qwen3-8b")
    budget = 80 * GIB
    seq = longest_sequence(cfg, Knobs("full", "standard"), budget)
    fits = estimate_memory(cfg, Knobs(checkpointing="full", loss="standard", sequence_len=seq))
    too_long = estimate_memory(cfg, Knobs(checkpointing="full", loss="standard", sequence_len=seq + 256))
    usable = int(budget * (1 - AUTO_MARGIN))  # the margin every "fits" keeps
    assert fits.total <= usable < too_long.total
    assert longest_sequence(cfg, Knobs("full", "fused_linear_ce"), budget) > seq
    assert longest_sequence(cfg, Knobs("full", "standard"), 10 * GIB) == 0  # the weights alone do not fit


def test_model_directory_config_needs_no_weights(tmp_path):
    from hone.models.presets import build_preset_config

    build_preset_config("llama3-8b", {"num_hidden_layers": 2}, None).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    cfg = parse_config({"model": {"path": str(tmp_path)}, "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}]}})
    est = estimate_memory(cfg, Knobs(checkpointing="full", loss="standard"))
    h, kv, inter, vocab = 4096, 1024, 14_336, 128_256
    layer = h * (h + kv + kv + h) + 3 * h * inter + 2 * h
    assert est.frozen_params == 2 * vocab * h + 2 * layer + h


def test_policy_and_loss_follow_the_config_with_or_without_the_new_keys():

    from hone.transforms.decide import decided_estimate
    from hone.transforms.memory.decide import checkpointing_of, loss_of

    cfg = _cfg("tiny-llama", memory__gradient_checkpointing=True)
    assert checkpointing_of(cfg) == "full" and loss_of(cfg) == "fused_linear_ce"  # auto: a plain head
    assert decided_estimate(cfg).checkpointing == "full"
    standard = _cfg("tiny-llama", memory__activation_checkpointing="offload", performance__loss="standard")
    assert checkpointing_of(standard) == "offload" and loss_of(standard) == "standard"
    assert decided_estimate(_cfg("tiny-llama", memory__activation_checkpointing="auto")).checkpointing == "none"  # as decided


# selective under Inductor (the compiler's activation memory budget), H100, 2026-11-26
# (benchmarks/2026-11-26-h100-seam.md): (preset, seq, micro-batch, targets, budget, measured GiB)
MEASURED_BUDGET = [
    ("qwen3-8b", 2048, 1, QKVO, 0.5, 19.86),
    ("qwen3-8b", 2048, 1, QKVO, 0.2, 17.75),
    ("llama3-8b", 4096, 2, ALL7, 0.4, 31.92),
    ("llama3-8b", 4096, 2, ALL7, 0.35, 31.42),
    ("llama3-8b", 4096, 2, ALL7, 0.3, 30.05),
    ("llama3-8b", 4096, 2, ALL7, 0.15, 25.14),
]


@pytest.mark.parametrize("row", MEASURED_BUDGET, ids=lambda r: f"{r[0]}-{r[1]}x{r[2]}-budget{r[4]}")
def test_selective_under_inductor_estimate_within_ten_percent_of_measured_peaks(row):
    preset, seq, mbs, targets, budget, measured = row
    cfg = _cfg(
        preset,
        adapter={"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": targets},
        seq=seq,
        mbs=mbs,
        memory__selective_memory_budget=budget,
        performance__torch_compile=True,
    )
    est = estimate_memory(cfg, Knobs(checkpointing="selective", loss="fused_linear_ce", compiled=True))
    assert est.total / GIB == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("small", ["fp8", "bf16"])
def test_fp8_lora_base_counts_two_float8_copies_of_each_wrapped_weight(small):
    """Against the built model: the float8 copies the fp8 transform keeps (two uint8 buffers a
    converted weight) are what the estimate adds to the weights; with small linears kept in bf16
    (every layer of this tiny model is small) there are none."""
    from hone.transforms.fp8 import convert_frozen_base
    from hone.transforms.memory.estimate import estimate_memory

    cfg = _cfg("tiny-llama", performance__fp8="rowwise", performance__fp8_small_linears=small)
    plain = estimate_memory(_cfg("tiny-llama"), Knobs(checkpointing="full", loss="standard", device="cpu"))
    fp8 = estimate_memory(cfg, Knobs(checkpointing="full", loss="standard", device="cpu"))
    model = load_model(cfg, load_tokenizer(cfg.model), "cpu").model
    details = convert_frozen_base(model, "rowwise", small=small)
    buffers = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if b.dtype == torch.uint8)
    assert fp8.weights - plain.weights == buffers
    assert (buffers > 0) == (small == "fp8") and (details["converted"] > 0) == (small == "fp8")


@pytest.mark.parametrize(("name", "per_weight"), [("adamw", 0), ("adamw_8bit", 8), ("adamw_4bit", 24)])
def test_low_bit_adamw_step_holds_the_largest_tensors_float32_temporaries(name, per_weight):
    """Measured on an H100: torchao's step over a 128256 x 3072 embedding holds 8.0 / 24.1 bytes a
    weight beside the moments; a full fine-tune of llama3.2-3b peaked at 21.1 / 24.1 GiB (8 / 4
    bits) in the optimizer step, where the moments alone gave 18.1 / 15.2."""
    cfg = _cfg("llama3.2-3b", adapter={"type": "none"}, optimizer__name=name)
    est = estimate_memory(cfg, Knobs(checkpointing="full", loss="fused_linear_ce"))
    facts = model_facts(cfg)
    assert est.phase == ("optimizer step" if per_weight else est.phase)
    assert est.optimizer_step == per_weight * facts.vocab * facts.hidden  # the tied embedding is the largest
    lora = estimate_memory(_cfg("llama3.2-3b", optimizer__name=name), Knobs(checkpointing="full", loss="fused_linear_ce"))
    assert lora.optimizer_step == 0 or lora.phase != "optimizer step"  # LoRA's tensors are small
