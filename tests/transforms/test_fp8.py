"""The fp8 transform on the CPU: config validation, the device refusal (with a fake compute
capability), which modules each case converts, a LoRA layer on a float8 base against the
dequantized reference (output, input gradient, LoRA gradients), checkpoints without float8
copies, a compiled converted layer, and torchao's full fine-tune conversion (emulated float8)
deep-copying and pickling."""

import copy
import pickle

import pytest
import torch
from torch import nn

from hone.config import parse_config
from hone.config.adapter import AdapterConfig
from hone.config.errors import ConfigError
from hone.kernels import fp8_linear
from hone.kernels.fp8_linear import fp8_linear_reference, quantize_frozen_weight
from hone.models.adapters import apply_adapter
from hone.testing import tiny_model, tiny_tokenizer, with_random_lora
from hone.transforms.base import RunFacts
from hone.transforms.fp8 import (
    Fp8FrozenLinear,
    convert_frozen_base,
    convert_full_finetune,
    fp8_device_problems,
)
from hone.transforms.planner import PlanError, decisions, plan_optimizations

_RAW = {"model": {"preset": "tiny-llama"}, "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca"}]}}
CUDA = torch.device("cuda")


def cfg(adapter="lora", model=None, **performance):
    return parse_config(
        {**_RAW, "model": {"preset": "tiny-llama", **(model or {})}, "adapter": {"type": adapter}, "performance": performance}
    )


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


# ---------------------------------------------------------------- config and device


def test_fp8_defaults_off_and_takes_the_two_scaling_modes():
    assert cfg().performance.fp8 == "off"
    assert cfg(fp8="rowwise").performance.fp8 == "rowwise"
    assert cfg(adapter="none", fp8="tensorwise").performance.fp8 == "tensorwise"
    with pytest.raises(ConfigError, match="fp8"):
        cfg(fp8="blockwise")


def test_fp8_needs_bf16_and_base_linears_need_lora_and_fp8():
    with pytest.raises(ConfigError, match=r"performance.fp8: rowwise needs model.dtype: bfloat16 \(got float32\)"):
        cfg(model={"dtype": "float32"}, fp8="rowwise")
    with pytest.raises(ConfigError, match="fp8_base_linears: all only applies with fp8 on"):
        cfg(fp8_base_linears="all")
    with pytest.raises(ConfigError, match="adapter.type is not lora"):
        cfg(adapter="none", fp8="rowwise", fp8_base_linears="all")
    assert cfg(fp8="rowwise", fp8_base_linears="all").performance.fp8_base_linears == "all"
    with pytest.raises(ConfigError, match="fp8_small_linears: bf16 only applies with fp8 on"):
        cfg(fp8_small_linears="bf16")
    with pytest.raises(ConfigError, match="fp8_small_linears"):
        cfg(fp8="rowwise", fp8_small_linears="fp16")
    assert cfg(fp8="rowwise").performance.fp8_small_linears == "fp8"


@pytest.mark.parametrize(
    "in_features, out_features, mode, small",
    [
        (3072, 1024, "tensorwise", True),  # a 3B model's key projection
        (4096, 1024, "tensorwise", True),  # an 8B model's
        (4096, 4096, "tensorwise", False),
        (4096, 2048, "tensorwise", False),
        (8192, 1024, "tensorwise", False),
        (3072, 1024, "rowwise", True),
        (3072, 3072, "rowwise", False),
        (2048, 4096, "rowwise", True),
        (4096, 14336, "rowwise", False),
        (1024, 8192, "rowwise", True),
    ],
)
def test_narrow_linears_are_too_small_for_fp8(in_features, out_features, mode, small):
    from hone.transforms.fp8_sizes import converts_to_fp8, too_small_for_fp8

    assert too_small_for_fp8(in_features, out_features, mode) is small
    assert converts_to_fp8(in_features, out_features, mode, "bf16") is not small
    assert converts_to_fp8(in_features, out_features, mode, "fp8")
    assert not converts_to_fp8(in_features + 8, out_features, mode, "fp8")  # not a multiple of 16


def test_device_check_refuses_cpu_and_gpus_older_than_ada_naming_key_device_and_what_is_allowed():
    (cpu,) = fp8_device_problems(torch.device("cpu"))
    assert "performance.fp8" in cpu and "(cpu)" in cpu and "compute capability >= 8.9" in cpu and "fp8: off" in cpu
    (ampere,) = fp8_device_problems(CUDA, capability=(8, 0))
    assert "compute capability 8.0" in ampere and ">= 8.9" in ampere and "fp8: off" in ampere
    assert fp8_device_problems(CUDA, capability=(8, 9)) == []
    assert fp8_device_problems(CUDA, capability=(9, 0)) == []


def test_the_plan_refuses_fp8_on_cpu_and_hone_plan_shows_it():
    with pytest.raises(PlanError, match=r"performance.fp8 needs float8 matmuls, which this run's device \(cpu\) lacks"):
        plan_optimizations(cfg(fp8="rowwise"), RunFacts(torch.device("cpu")))
    lines = {name: (on, why) for name, _, on, why in decisions(cfg(fp8="rowwise"), RunFacts(torch.device("cpu")))}
    assert lines["fp8"][0] and lines["fp8"][1].startswith("REFUSED")
    on, why = {n: (o, w) for n, _, o, w in decisions(cfg(fp8="tensorwise"), RunFacts(CUDA))}["fp8"]
    assert on and "frozen base in float8" in why and "narrow" not in why
    _, why = {n: (o, w) for n, _, o, w in decisions(cfg(fp8="tensorwise", fp8_small_linears="bf16"), RunFacts(CUDA))}["fp8"]
    assert "narrow linears stay bf16 (fp8_small_linears: bf16)" in why
    assert not {n: o for n, _, o, _ in decisions(cfg(), RunFacts(CUDA))}["fp8"]


def test_fp8_emulate_lets_a_full_finetune_plan_on_cpu_but_not_a_frozen_lora_base():
    emulated = cfg(adapter="none", fp8="tensorwise", fp8_emulate=True)
    assert "fp8" in plan_optimizations(emulated, RunFacts(torch.device("cpu"))).names
    _, _, on, why = next(d for d in decisions(emulated, RunFacts(torch.device("cpu"))) if d[0] == "fp8")
    assert on and "emulated (fp8_emulate" in why
    # hone's frozen-base kernel has no emulation: refused, the key named
    with pytest.raises(PlanError, match=r"performance.fp8_emulate: true applies to a full fine-tune"):
        plan_optimizations(cfg(fp8="tensorwise", fp8_emulate=True), RunFacts(torch.device("cpu")))
    with pytest.raises(PlanError, match=r"this run's device \(cpu\) lacks"):
        plan_optimizations(cfg(adapter="none", fp8="tensorwise"), RunFacts(torch.device("cpu")))
    with pytest.raises(ConfigError, match="fp8_emulate: True only applies with fp8 on"):
        cfg(adapter="none", fp8_emulate=True)


def _two_ranks(model: str, adapter: str, fp8: str, distributed: dict):
    from hone.runtime.world import World

    config = parse_config(
        {
            **_RAW,
            "model": {"preset": model, "dtype": "bfloat16"},
            "adapter": {"type": adapter},
            "performance": {"fp8": fp8},
            "distributed": distributed,
        }
    )
    return plan_optimizations(config, RunFacts(CUDA, world=World(rank=0, world_size=2, local_rank=0)))


@pytest.mark.parametrize("adapter, fp8", [("none", "tensorwise"), ("none", "rowwise"), ("lora", "tensorwise")])
def test_fp8_scaled_over_whole_tensors_is_refused_with_context_parallelism_naming_both_keys(adapter, fp8):
    what = "a full fine-tune" if adapter == "none" else "a frozen LoRA base"
    with pytest.raises(PlanError, match=rf"performance.fp8: {fp8} on {what} with distributed.context_parallel: 2: .*own part"):
        _two_ranks("tiny-qwen3", adapter, fp8, {"context_parallel": 2})


def test_fp8_per_token_scales_and_expert_parallel_fsdp2_plan():
    # the frozen base's rowwise scales are per token: a split sequence quantizes as the whole one
    assert "context_parallel" in _two_ranks("tiny-qwen3", "lora", "rowwise", {"context_parallel": 2}).names
    # the converted linears are FSDP2's over the whole world (the experts are no linears: they stay bf16)
    names = _two_ranks("tiny-qwen3-moe", "none", "tensorwise", {"strategy": "fsdp", "expert_parallel": 2}).names
    assert {"fp8", "expert_parallel", "fsdp"} <= set(names)


def test_fp8_auto_takes_the_scaling_measured_faster_for_each_case_and_the_plan_says_so():
    """auto is float8 with a rule: tensorwise on one process (LoRA and full fine-tune) and for a
    full fine-tune under FSDP2, rowwise for LoRA under context parallelism; what auto chose is what
    the transform applies, the plan prints and the memory estimate counts."""
    from hone.transforms.fp8_sizes import fp8_scaling
    from hone.transforms.plan_report import resolved_optimizations

    lora, full = cfg(fp8="auto"), cfg(adapter="none", fp8="auto")
    assert fp8_scaling(lora, fsdp=False)[0] == "tensorwise"
    assert fp8_scaling(full, fsdp=False)[0] == "tensorwise"
    assert fp8_scaling(full, fsdp=True) == (
        "tensorwise",
        "performance.fp8: auto: tensorwise, measured faster than rowwise under FSDP2 (1.13x vs 0.97x bf16)",
    )
    assert fp8_scaling(cfg(fp8="rowwise"), fsdp=False) == ("rowwise", "performance.fp8: rowwise")
    assert fp8_scaling(cfg(), fsdp=False) == ("off", "performance.fp8: off")

    plan = plan_optimizations(lora, RunFacts(CUDA))
    assert plan.decided.fp8 == "tensorwise" and "fp8" in plan.names
    _, _, on, why = next(d for d in decisions(lora, RunFacts(CUDA)) if d[0] == "fp8")
    assert on and why.startswith("performance.fp8: auto: tensorwise, measured faster than rowwise for a LoRA base")
    assert ("fp8", "tensorwise (auto)", "performance.fp8") in resolved_optimizations(lora, "cuda", plan.decided)
    with pytest.raises(PlanError, match=r"performance.fp8 needs float8 matmuls, which this run's device \(cpu\) lacks"):
        plan_optimizations(lora, RunFacts(torch.device("cpu")))  # auto asks for float8: refused where there is none
    # under context parallelism a LoRA base takes the per-token scales that split cleanly
    split = _two_ranks("tiny-qwen3", "lora", "auto", {"context_parallel": 2})
    assert split.decided.fp8 == "rowwise" and "context_parallel" in split.names
    # a full fine-tune under FSDP2: tensorwise, so the weights are gathered in float8 (cast once a step)
    sharded = _two_ranks("tiny-qwen3", "none", "auto", {"strategy": "fsdp"})
    assert sharded.decided.fp8 == "tensorwise"
    with pytest.raises(PlanError, match=r"performance.fp8: auto \(tensorwise\) on a full fine-tune with distributed.context"):
        _two_ranks("tiny-qwen3", "none", "auto", {"context_parallel": 2})


def test_fp8_auto_estimates_the_copies_of_the_scaling_it_takes():
    """fp8_small_linears: bf16 keeps different layers per scaling (qwen3-30b-a3b's q_proj, 2048 ->
    4096, is narrow for rowwise only): the estimate of auto is that of the scaling auto takes."""
    from hone.transforms.memory.facts import model_facts
    from hone.transforms.memory.terms.fp8 import fp8_copies_bytes

    def copies(fp8, distributed=None):
        raw = {**_RAW, "model": {"preset": "qwen3-30b-a3b", "dtype": "bfloat16"}, "adapter": {"type": "lora"}}
        raw["performance"] = {"fp8": fp8, "fp8_small_linears": "bf16"}
        raw["distributed"] = distributed or {}
        config = parse_config(raw)
        return fp8_copies_bytes(config, model_facts(config))

    assert copies("auto") == copies("tensorwise") != copies("rowwise")
    assert copies("auto", {"context_parallel": 2}) == copies("rowwise")


@pytest.mark.parametrize(
    "performance, key",
    [
        ({"torch_compile_options": {"max_autotune_gemm": True}}, "performance.torch_compile_options.max_autotune_gemm: true"),
        ({"torch_compile_mode": "max-autotune"}, "performance.torch_compile_mode: max-autotune"),
        ({"torch_compile_mode": "max-autotune-no-cudagraphs"}, "performance.torch_compile_mode: max-autotune-no-cudagraphs"),
    ],
)
@pytest.mark.parametrize("adapter", ["lora", "none"])
def test_fp8_refuses_inductors_autotuned_matmul_templates_naming_the_key(performance, key, adapter):
    config = cfg(adapter=adapter, fp8="tensorwise", torch_compile=True, **performance)
    with pytest.raises(
        PlanError, match=r"performance.fp8 with Inductor's max-autotune matmul templates \(" + key.replace(".", r"\.") + r"\)"
    ):
        plan_optimizations(config, RunFacts(CUDA))
    assert not [
        p
        for p in _fp8_problems(cfg(adapter=adapter, fp8="tensorwise", torch_compile=True, torch_compile_mode="reduce-overhead"))
        if "autotune" in p
    ]


def _fp8_problems(config):
    from hone.transforms.base import PlanContext
    from hone.transforms.decide import decide
    from hone.transforms.fp8 import FP8

    facts = RunFacts(CUDA)
    return FP8.check(PlanContext(config, facts, decide(config, facts)))


def test_plan_puts_fp8_before_checkpointing_and_compile():
    if torch.cuda.is_available():
        pytest.skip("the CPU-machine plan of a CUDA run")
    plan = plan_optimizations(cfg(fp8="rowwise", torch_compile=True), RunFacts(CUDA))
    assert plan.names.index("fp8") < plan.names.index("compile")


# ---------------------------------------------------------------- frozen base (LoRA)


def _lora_model(tokenizer, targets):
    model = tiny_model("tiny-llama", tokenizer, seed=3)
    return apply_adapter(model, AdapterConfig(type="lora", lora_r=4, lora_target_modules=targets))


def _kinds(model):
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_frozen_base_converts_the_base_layers_of_the_lora_targets_only(tokenizer):
    model = _lora_model(tokenizer, ["q_proj", "v_proj", "down_proj"])
    details = convert_frozen_base(model, "rowwise")
    kinds = _kinds(model)
    fp8 = sorted(n for n, k in kinds.items() if k == "Fp8FrozenLinear")
    assert len(fp8) == 6 and details["converted"] == 6 and details["skipped"] == []
    assert all(n.endswith(("q_proj.base_layer", "v_proj.base_layer", "down_proj.base_layer")) for n in fp8)
    assert all(k == "Linear" for n, k in kinds.items() if "lora_" in n or n.endswith(("k_proj", "o_proj", "lm_head")))


def test_small_linears_stay_bf16_in_both_cases_when_asked(tokenizer):
    """A model whose key/value projections are narrow (64 -> 16) and the rest wide enough."""
    from hone.transforms.fp8_sizes import too_small_for_fp8

    model = _lora_model(tokenizer, ["q_proj", "k_proj", "v_proj", "up_proj"])
    small = {
        n
        for n, m in model.named_modules()
        if type(m) is nn.Linear and "lora_" not in n and too_small_for_fp8(m.in_features, m.out_features, "tensorwise")
    }
    assert small  # the tiny model's linears are all narrow
    details = convert_frozen_base(model, "tensorwise", small="bf16")
    assert details["converted"] == 0 and len(details["kept_bf16_small"]) == 2 * 4
    full = tiny_model("tiny-llama", tokenizer, seed=3)
    details = convert_full_finetune(full, "tensorwise", emulate=True, small="bf16")
    assert details["converted"] == 0 and details["kept_bf16_small"] == 2 * 7


def test_frozen_base_all_converts_every_frozen_linear_but_the_head(tokenizer):
    model = _lora_model(tokenizer, ["q_proj"])
    details = convert_frozen_base(model, "tensorwise", scope="all")
    kinds = _kinds(model)
    assert details["converted"] == 2 * 7  # seven projections per layer, two layers
    assert kinds["base_model.model.lm_head"] == "Linear"
    assert all(k == "Linear" for n, k in kinds.items() if "lora_" in n)


def test_frozen_base_keeps_the_checkpoint_as_it_was(tokenizer):
    model = _lora_model(tokenizer, ["q_proj", "v_proj"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convert_frozen_base(model, "rowwise")
    after = model.state_dict()
    assert set(after) == set(before)  # no float8 copy is saved
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("mode", ["rowwise", "tensorwise"])
def test_lora_layer_on_a_float8_base_equals_the_dequantized_reference(tokenizer, mode):
    model = with_random_lora(tiny_model("tiny-llama", tokenizer, seed=4), seed=5)
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    base_weight = layer.base_layer.weight.detach().clone()
    convert_frozen_base(model, mode)
    assert isinstance(layer.base_layer, Fp8FrozenLinear)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 7, base_weight.shape[1], generator=gen)
    grad = torch.randn(2, 7, base_weight.shape[0], generator=gen)

    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    layer(x1).backward(grad)
    got = {"dx": x1.grad, **{n: p.grad.clone() for n, p in layer.named_parameters() if p.requires_grad}}
    layer.zero_grad()
    a, b = layer.lora_A["default"], layer.lora_B["default"]
    ref = fp8_linear_reference(x2, quantize_frozen_weight(base_weight, mode)) + b(a(x2)) * layer.scaling["default"]
    ref.backward(grad)
    want = {"dx": x2.grad, **{n: p.grad for n, p in layer.named_parameters() if p.requires_grad}}
    assert set(got) == {"dx", "lora_A.default.weight", "lora_B.default.weight"}
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)
    assert layer.base_layer.weight.grad is None  # frozen: no weight gradient


def test_converted_model_tracks_the_unconverted_one_and_compiles_fullgraph(tokenizer):
    model = with_random_lora(tiny_model("tiny-llama", tokenizer, seed=7), seed=8)
    ids = torch.randint(0, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        exact = model(input_ids=ids).logits
    convert_frozen_base(model, "rowwise")
    with torch.no_grad():
        fp8 = model(input_ids=ids).logits
    rel = ((fp8 - exact).norm() / exact.norm()).item()
    assert 1e-5 < rel < 0.08

    layer = model.base_model.model.model.layers[0]
    hidden = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(10))
    position_ids = torch.arange(12).expand(2, -1)
    rotary = model.base_model.model.model.rotary_emb(hidden, position_ids)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    first = lambda out: out if torch.is_tensor(out) else out[0]  # noqa: E731 (layers return a tensor or a tuple)
    torch.testing.assert_close(
        first(compiled(hidden, position_embeddings=rotary)), first(layer(hidden, position_embeddings=rotary))
    )


@pytest.mark.parametrize("mode", ["rowwise", "tensorwise"])
def test_a_converted_layer_compiles_and_trains_with_dynamic_shapes(tokenizer, mode):
    """Rows of varying length compile with ``dynamic=True``, where Dynamo traces module-level floats
    as symbolic floats: the quantization's constants, were they read from globals, would fail
    the second float8 matmul of the layer (``lift_tracked_freevar_to_input``; the bundled chat
    data's LoRA run did on an H200)."""
    assert (fp8_linear.FP8_MAX, fp8_linear._EPS) == (448.0, 1e-12)  # the literals quantize() writes out
    model = with_random_lora(tiny_model("tiny-qwen3", tokenizer, seed=7), seed=8)
    convert_frozen_base(model, mode, "all")
    layer = model.base_model.model.model.layers[0]
    rotary_emb = model.base_model.model.model.rotary_emb
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    first = lambda out: out if torch.is_tensor(out) else out[0]  # noqa: E731
    for length in (12, 20):
        hidden = torch.randn(2, length, 64, generator=torch.Generator().manual_seed(length))
        rotary = rotary_emb(hidden, torch.arange(length).expand(2, -1))
        grads = []
        for run in (compiled, layer):
            x = hidden.clone().requires_grad_(True)
            out = first(run(x, position_embeddings=rotary))
            (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
            grads.append((out.detach(), x.grad))
        torch.testing.assert_close(grads[0], grads[1])


# ---------------------------------------------------------------- full fine-tune (torchao)


def test_full_finetune_converts_every_linear_but_the_head_and_copies_and_pickles(tokenizer):
    from torchao.float8.float8_linear import Float8Linear

    model = tiny_model("tiny-llama", tokenizer, seed=11)
    ids = torch.randint(0, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(12))
    exact = model(input_ids=ids, labels=ids).loss.item()
    details = convert_full_finetune(model, "rowwise", emulate=True)
    assert details["converted"] == 2 * 7 and details["kept_high_precision"] == 1
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert all(isinstance(m, Float8Linear) for n, m in model.named_modules() if n.endswith("proj"))

    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - exact) / exact < 0.02
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None  # full fine-tune: weights train

    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert isinstance(twin.model.layers[1].self_attn.q_proj, Float8Linear)
        torch.testing.assert_close(twin(input_ids=ids, labels=ids).loss, loss.detach())


def test_full_finetune_float8_all_gather_only_with_tensorwise():
    from hone.transforms.fp8 import float8_training_config

    assert float8_training_config("tensorwise", fsdp_float8_all_gather=True).enable_fsdp_float8_all_gather
    assert not float8_training_config("rowwise", fsdp_float8_all_gather=True).enable_fsdp_float8_all_gather
    assert not float8_training_config("tensorwise").enable_fsdp_float8_all_gather


def test_full_finetune_converts_on_the_meta_device_for_the_sharded_loader(tokenizer):
    """The sharded loader applies the plan before any weight exists, then materialises them."""
    from torchao.float8.float8_linear import Float8Linear
    from transformers import AutoModelForCausalLM

    from hone.models.presets import build_preset_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_preset_config("tiny-llama", {}, len(tokenizer)))
    convert_full_finetune(model, "tensorwise", fsdp_float8_all_gather=True, emulate=True)
    model.to_empty(device="cpu")
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, Float8Linear) and layer.weight.device.type == "cpu"


def test_the_estimate_counts_the_float8_shards_fsdp2_keeps_cast_for_the_steps_all_gathers():
    """Under FSDP2 with tensorwise scaling each converted weight's shard is kept in float8 between
    optimizer steps (hone.transforms.fp8_cast_once): 1 byte a weight, whole here (the estimate
    shards it with the weights); rowwise gathers bf16 and one process gathers nothing."""
    from hone.transforms.memory.estimate import float8_of
    from hone.transforms.memory.facts import model_facts
    from hone.transforms.memory.terms.fp8 import fp8_copies_bytes

    raw = {**_RAW, "model": {"preset": "tiny-llama", "dtype": "bfloat16"}, "adapter": {"type": "none"}}
    config = parse_config({**raw, "performance": {"fp8": "tensorwise"}})
    m = model_facts(config)
    elements = sum(lf.in_features * lf.out_features for layer in m.layers for lf in layer.linears)
    assert elements > 0
    assert fp8_copies_bytes(config, m, float8_of(config, 2), 2) == elements
    assert fp8_copies_bytes(config, m, float8_of(config, 1), 1) == 0
    rowwise = parse_config({**raw, "performance": {"fp8": "rowwise"}})
    assert fp8_copies_bytes(rowwise, m, float8_of(rowwise, 2), 2) == 0
