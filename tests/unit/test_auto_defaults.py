"""Fast by default: every speed decision a config leaves out is ``auto``, decided once per plan
from the model, the device and the data (:func:`hone.transforms.decide.decide`), and an explicit
value always wins. Devices are described, not used: a CPU, an 80 GB and a 24 GB CUDA card given
as facts (no GPU needed; the meta-device model is all the estimate reads)."""

import pytest
import torch

from hone.config import parse_config
from hone.config.errors import ConfigError
from hone.config.memory import SELECTIVE_BUDGET_FLOOR, SELECTIVE_BUDGET_STEP
from hone.transforms.base import RunFacts
from hone.transforms.decide import decide
from hone.transforms.memory.decide import auto_limit
from hone.transforms.memory.estimate import estimate_memory
from hone.transforms.memory.knobs import Knobs
from hone.transforms.planner import plan_optimizations
from hone.units import GIB

HOST = 128 * GIB
CPU = RunFacts(torch.device("cpu"), memory_bytes=24 * GIB, host_memory_bytes=HOST)
H100 = RunFacts(torch.device("cuda"), memory_bytes=80 * GIB, host_memory_bytes=HOST)
CARD_24GB = RunFacts(torch.device("cuda"), memory_bytes=24 * GIB, host_memory_bytes=HOST)
VARYING = RunFacts(
    torch.device("cuda"), shape_note="the training rows are 3 to 90 tokens long", memory_bytes=80 * GIB, host_memory_bytes=HOST
)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_SEVEN = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def config(preset="qwen3-8b", seq=2048, targets=ATTENTION, layers=None, **sections):
    model = {"preset": preset, "dtype": "bfloat16", **sections.pop("model", {})}
    if layers:
        model["preset_overrides"] = {"num_hidden_layers": layers}
    raw = {
        "model": model,
        "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}], "sequence_len": seq},
        "adapter": {"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": targets},
    }
    for key, section in sections.items():
        full_finetune = key == "adapter" and section.get("type") == "none"  # drops the LoRA keys
        raw[key] = section if full_finetune else {**raw.get(key, {}), **section}
    return parse_config(raw)


def moe(**sections):
    return config("qwen3-30b-a3b", targets=[*ATTENTION, "experts"], layers=8, **sections)


# ---------------------------------------------------------------------------------- compile


def test_compile_auto_is_regional_on_cuda_and_eager_on_cpu():
    cfg = config()
    assert decide(cfg, H100).compile is True and "regional" in decide(cfg, H100).compile_why
    assert decide(cfg, CPU).compile is False
    assert decide(config(performance={"torch_compile": False}), H100).compile is False
    assert decide(config(performance={"torch_compile": True}), CPU).compile is True


# ---------------------------------------------------------------------------------- experts


def test_experts_auto_runs_hone_kernels_on_cuda_and_grouped_mm_elsewhere():
    on_gpu = decide(moe(), H100)
    assert on_gpu.experts_implementation == "hone" and on_gpu.experts_why.startswith("experts_implementation: auto: hone")
    on_cpu = decide(moe(), CPU)
    assert on_cpu.experts_implementation == "grouped_mm" and "CUDA only" in on_cpu.experts_why
    dense = decide(config(), H100)
    assert dense.experts_implementation == "grouped_mm" and "no mixture-of-experts layers" in dense.experts_why
    for asked in ("grouped_mm", "eager"):
        assert decide(moe(model={"experts_implementation": asked}), H100).experts_implementation == asked


def test_experts_auto_keeps_transformers_where_the_kernels_do_not_know_the_layout(monkeypatch):
    from hone.transforms.memory import facts

    real = facts._experts_layout_problems
    monkeypatch.setattr(facts, "_experts_layout_problems", lambda base: ("Qwen3MoeExperts: its experts have no gate",))
    facts._facts_cached.cache_clear()
    try:
        chosen = decide(moe(), H100)
    finally:
        monkeypatch.setattr(facts, "_experts_layout_problems", real)
        facts._facts_cached.cache_clear()
    assert chosen.experts_implementation == "grouped_mm"
    assert chosen.experts_why.endswith("hone's kernels cannot run Qwen3MoeExperts: its experts have no gate")


def test_the_experts_transform_applies_what_auto_decided():
    assert "experts" in plan_optimizations(moe(), H100).names
    assert "experts" not in plan_optimizations(moe(), CPU).names
    assert "experts" not in plan_optimizations(config(), H100).names


# ---------------------------------------------------------------------------------- CUDA graphs


def test_cuda_graphs_auto_turn_on_for_hone_experts_with_one_shape_only():
    assert decide(moe(), H100).cuda_graphs is True
    assert decide(moe(model={"quantize": "mxfp4"}), H100).cuda_graphs is True  # measured: MXFP4 experts replay too
    off = {
        "dense step (GPU-bound)": (config(), H100, "bound by the GPU"),
        "rows of different lengths": (moe(), VARYING, "3 to 90 tokens"),
        # where graphs would not pay anyway, that is the reason given, not the shapes
        "dense step (GPU-bound), rows of different lengths": (config(), VARYING, "bound by the GPU"),
        "on the CPU": (moe(), CPU, "not compiled"),
        "full checkpointing": (moe(memory={"activation_checkpointing": "full"}), H100, "checkpointing full"),
        "eager": (moe(performance={"torch_compile": False}), H100, "not compiled"),
        "grouped_mm experts": (moe(model={"experts_implementation": "grouped_mm"}), H100, "bound by the GPU"),
        "whole-model compile": (moe(performance={"torch_compile_scope": "model"}), H100, "torch_compile_scope: model"),
        "NF4 base": (moe(model={"quantize": "nf4"}, memory={"activation_checkpointing": "none"}), H100, "an NF4 base"),
        "float8 full fine-tune (GPU-bound)": (
            config(adapter={"type": "none"}, performance={"fp8": "tensorwise"}, memory={"activation_checkpointing": "none"}),
            H100,
            "a float8 full fine-tune is bound by the GPU",
        ),
        "float8 base, rows of different lengths": (config(performance={"fp8": "tensorwise"}), VARYING, "3 to 90 tokens"),
    }
    for case, (cfg, facts, reason) in off.items():
        chosen = decide(cfg, facts)
        assert chosen.cuda_graphs is False, case
        assert chosen.cuda_graphs_why.startswith("cuda_graphs: auto: off") and reason in chosen.cuda_graphs_why, case


def test_cuda_graphs_auto_turn_on_for_lora_on_a_float8_base():
    """Its quantization passes make the dense step host-bound (qwen3-8b: 146.9 -> 94.5 ms with graphs)."""
    for fp8 in ("tensorwise", "rowwise", "auto"):
        chosen = decide(config(performance={"fp8": fp8, "fp8_base_linears": "all"}), H100)
        assert chosen.cuda_graphs is True, fp8
        assert "a float8 base's quantization passes make the step host-bound" in chosen.cuda_graphs_why
    assert decide(config(performance={"fp8": "tensorwise"}), H100).cuda_graphs is True  # LoRA targets only: launches too
    assert decide(config(), H100).cuda_graphs is False  # the same run in bf16: GPU-bound
    expert_lora = decide(moe(performance={"fp8": "tensorwise"}), H100)
    assert "MoE experts on hone's kernels" in expert_lora.cuda_graphs_why  # the first reason that applies


def test_fp8_base_linears_auto_converts_every_frozen_linear_where_graphs_replay_the_step():
    """``auto``: ``all`` with CUDA graphs (94.5 ms on qwen3-8b), the LoRA targets without them
    (120.6 against 146.9 ms: the step is host-bound); decided with the float8 copies counted, so
    a card where ``all`` would need checkpointing that stops the graphs keeps the targets."""
    from hone.transforms.decide import as_decided, decided_estimate
    from hone.transforms.fp8 import fp8_why

    fp8 = {"performance": {"fp8": "tensorwise"}}
    graphs = decide(config(**fp8), H100)
    assert graphs.cuda_graphs and graphs.fp8_base_linears == "all"
    assert graphs.fp8_base_linears_why.startswith("performance.fp8_base_linears: auto: all, CUDA graphs replay the step")
    assert "all frozen linears but the head" in fp8_why(config(**fp8), graphs)
    assert as_decided(config(**fp8), graphs).performance.fp8_base_linears == "all"
    targets_only = estimate_memory(
        config(performance={"fp8": "tensorwise", "fp8_base_linears": "lora_targets"}), Knobs("none", "fused")
    )
    every = estimate_memory(config(performance={"fp8": "tensorwise", "fp8_base_linears": "all"}), Knobs("none", "fused"))
    assert every.total > targets_only.total  # the frozen MLP's float8 copies
    assert decided_estimate(config(**fp8), "cuda", memory_bytes=80 * GIB).total == pytest.approx(every.total, rel=0.02)

    varying = decide(config(**fp8), VARYING)
    assert not varying.cuda_graphs and varying.fp8_base_linears == "lora_targets"
    assert "auto: lora_targets, every frozen linear in float8 would run without CUDA graphs" in varying.fp8_base_linears_why
    assert "3 to 90 tokens" in varying.fp8_base_linears_why
    small = decide(config(**fp8), CARD_24GB)  # all's copies need checkpointing that stops the graphs
    assert small.fp8_base_linears == "lora_targets" and small.cuda_graphs
    assert "re-runs each layer's forward" in small.fp8_base_linears_why
    written = decide(config(performance={"fp8": "tensorwise", "fp8_base_linears": "lora_targets"}), H100)
    assert (
        written.fp8_base_linears == "lora_targets"
        and written.fp8_base_linears_why == "performance.fp8_base_linears: lora_targets"
    )
    assert decide(config(), H100).fp8_base_linears_why is None  # no float8 base: nothing to decide


def test_cuda_graphs_written_in_the_config_override_auto():
    assert decide(config(performance={"cuda_graphs": True}), H100).cuda_graphs is True
    assert decide(moe(performance={"cuda_graphs": False}), H100).cuda_graphs is False
    by_option = decide(moe(performance={"torch_compile_options": {"triton.cudagraphs": False}}), H100)
    assert by_option.cuda_graphs is False
    assert by_option.cuda_graphs_why == "performance.torch_compile_options.triton.cudagraphs: false"
    assert decide(config(performance={"torch_compile_mode": "reduce-overhead"}), H100).cuda_graphs is True


def test_cuda_graphs_reach_inductor_as_its_option_only_where_decided():
    from hone.transforms.compile import _compile_kwargs

    perf = moe().performance
    assert _compile_kwargs(perf, dynamic=False, cuda_graphs=True)["options"] == {"triton.cudagraphs": True}
    assert "options" not in _compile_kwargs(perf, dynamic=False, cuda_graphs=False)


@pytest.mark.parametrize(
    ("performance", "message"),
    [
        ({"cuda_graphs": True, "torch_compile": False}, "cuda_graphs: true records Inductor's compiled kernels"),
        ({"cuda_graphs": False, "torch_compile_options": {"triton.cudagraphs": True}}, "disagrees with"),
        ({"cuda_graphs": True, "torch_compile_mode": "max-autotune-no-cudagraphs"}, "disagrees with"),
        ({"cuda_graphs": True, "torch_compile_backend": "aot_eager"}, "cuda_graphs configure Inductor"),
    ],
)
def test_cuda_graphs_settings_that_contradict_each_other_are_refused(performance, message):
    with pytest.raises(ConfigError, match=message):
        config(performance=performance)


def test_cuda_graphs_on_packed_rows_fix_the_boundaries_whether_asked_or_chosen_by_auto():
    """Packed rows count as one shape: wherever the plan records graphs (``true``, or ``auto`` on
    a host-bound MoE step, measured 62.2 -> 33.5 ms on packed rows), the hooks ask the batches for
    one boundary count (hone.train.batches.PackedBatches); without graphs they leave them free."""
    from hone.testing import tiny_model, tiny_tokenizer
    from hone.train.run import shape_note

    model = tiny_model("tiny-qwen3", tiny_tokenizer())
    for explicit, on in ((True, True), ("auto", True), (False, False)):
        cfg = moe(performance={"cuda_graphs": explicit}, data={"sample_packing": True})
        assert shape_note(cfg, None) is None
        facts = RunFacts(torch.device("cuda"), memory_bytes=80 * GIB, host_memory_bytes=HOST)
        plan = plan_optimizations(cfg, facts)
        assert plan.decided.cuda_graphs is on, plan.decided.cuda_graphs_why
        assert plan.hooks(model, cfg, facts).fixed_boundaries is on
    dense = config(performance={"cuda_graphs": "auto"}, data={"sample_packing": True})
    decided = plan_optimizations(dense, RunFacts(torch.device("cuda"), memory_bytes=80 * GIB, host_memory_bytes=HOST)).decided
    assert not decided.cuda_graphs and "bound by the GPU" in decided.cuda_graphs_why


# ---------------------------------------------------------------------------------- checkpointing


def test_checkpointing_auto_keeps_everything_where_it_fits_and_saves_memory_on_a_small_card():
    assert decide(config(), H100).checkpointing == "none"
    small = decide(config(), CARD_24GB)
    assert small.checkpointing == "selective" and "none needs" in small.checkpointing_why
    assert decide(config("tiny-llama", seq=256), CPU).checkpointing == "none"  # a tiny model in the CPU's RAM
    assert decide(config(), CPU).checkpointing == "full"  # an 8B one in 24 GiB, where offload (CUDA only) is no choice
    assert decide(config(memory={"activation_checkpointing": "full"}), H100).checkpointing == "full"
    assert decide(config(memory={"activation_checkpointing": "none"}), CARD_24GB).checkpointing == "none"


def test_the_selective_budget_is_the_largest_that_fits():
    cfg = config()
    chosen = decide(cfg, CARD_24GB)
    budget = chosen.compiler_memory_budget
    assert SELECTIVE_BUDGET_FLOOR <= budget < 1 and chosen.compiler_memory_budget_why.startswith(
        f"selective_memory_budget: auto: {budget}, the largest that fits"
    )
    usable, _ = auto_limit(24 * GIB, "")
    knobs = Knobs("selective", "fused_linear_ce", device="cuda", host_budget=HOST)

    def peak(fraction):
        return estimate_memory(cfg, Knobs(**{**knobs.__dict__, "selective_budget": fraction})).total

    assert peak(budget) <= usable < peak(round(budget + SELECTIVE_BUDGET_STEP, 2))
    written = decide(config(memory={"activation_checkpointing": "selective", "selective_memory_budget": 0.3}), CARD_24GB)
    assert written.compiler_memory_budget == 0.3 and written.compiler_memory_budget_why == "memory.selective_memory_budget: 0.3"
    assert decide(config(), CPU).compiler_memory_budget is None  # eager: no compiler budget


def test_a_quantized_base_never_keeps_every_activation_and_selective_keeps_the_least():
    qlora = config(targets=ALL_SEVEN, model={"quantize": "nf4"})
    for card in (H100, CARD_24GB):
        chosen = decide(qlora, card)
        assert chosen.checkpointing == "selective" and chosen.compiler_memory_budget == SELECTIVE_BUDGET_FLOOR
        assert "a quantized base (model.quantize: nf4) asks for little memory" in chosen.checkpointing_why
        assert chosen.compile is True and chosen.cuda_graphs is False
    assert decide(config(), H100).checkpointing == "none"  # the same model unquantized keeps everything
    written = config(targets=ALL_SEVEN, model={"quantize": "nf4"}, memory={"activation_checkpointing": "none"})
    assert decide(written, H100).checkpointing == "none"
    budget = config(targets=ALL_SEVEN, model={"quantize": "nf4"}, memory={"selective_memory_budget": 0.5})
    assert decide(budget, H100).compiler_memory_budget == 0.5


def test_a_32k_step_fits_an_80gb_card_with_the_policy_auto_chooses():
    cfg = config(seq=32768)
    chosen = decide(cfg, H100)
    assert chosen.checkpointing != "none"
    knobs = Knobs(
        chosen.checkpointing,
        "fused_linear_ce",
        device="cuda",
        host_budget=HOST,
        tiled_mlp=chosen.tiled_mlp_shards,
        tiled_layers=chosen.tiled_layers_chunks,
        selective_budget=chosen.compiler_memory_budget,
    )
    assert estimate_memory(cfg, knobs).total <= auto_limit(80 * GIB, "")[0]


# ---------------------------------------------------------------------------------- the record


def test_the_run_prints_and_records_each_auto_choice(tmp_path):
    import json

    from hone.transforms.planner import write_record

    cfg = moe()
    plan = plan_optimizations(cfg, H100)
    lines = plan.auto_choices(cfg)
    assert [line.split(":")[0] for line in lines] == [
        "torch_compile",
        "cuda_graphs",
        "experts_implementation",
        "activation_checkpointing",
    ]
    record = json.loads(write_record(tmp_path, plan).read_text())
    assert record["decided"]["experts_implementation"] == "hone" and record["decided"]["cuda_graphs"] is True
    assert record["decided"]["cuda_graphs_why"] == plan.decided.cuda_graphs_why
    explicit = moe(
        performance={"torch_compile": True, "cuda_graphs": True},
        model={"experts_implementation": "hone"},
        memory={"activation_checkpointing": "none"},
    )
    assert plan_optimizations(explicit, H100).auto_choices(explicit) == []  # nothing left to auto
