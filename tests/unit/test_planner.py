"""The optimization planner: what it applies in which order, what it refuses before the model
loads, the record it writes; finding decoder layers through PEFT; the compile watch."""

import json

import pytest
import torch
from torch import nn

from hone.config import parse_config
from hone.config.adapter import AdapterConfig
from hone.config.performance import PerformanceConfig
from hone.models.adapters import apply_adapter
from hone.models.structure import decoder_layers
from hone.run_files import OPTIMIZATIONS_FILE
from hone.testing import tiny_model
from hone.train.run import shape_note
from hone.transforms.base import RunFacts, Transform
from hone.transforms.compile import compile_regional
from hone.transforms.planner import TRANSFORMS, PlanError, plan_optimizations, write_record
from hone.transforms.watch import CompileEvent, CompileWatch

CPU, CUDA = RunFacts(torch.device("cpu")), RunFacts(torch.device("cuda"))
VARYING = RunFacts(torch.device("cuda"), shape_note="the training rows are 3 to 9 tokens long")


_RAW = {"model": {"preset": "tiny-llama"}, "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca"}]}}


def cfg(**performance):
    return parse_config({**_RAW, "performance": performance})


ALWAYS = ["attention", "fused_lora_linear", "loss"]  # every LoRA run picks an attention kernel, its LoRA layers and a loss


def test_nothing_asked_plans_the_attention_kernel_and_the_loss_and_compiles_on_cuda_only():
    plan = plan_optimizations(cfg(), CPU)
    assert plan.names == ALWAYS and plan.skipped == []  # the defaults' auto choices are no skipped requests
    assert plan.describe() == "optimizations: none"  # nothing applied yet
    assert plan.decided.compile is False and plan.decided.checkpointing == "none"
    assert plan.auto_choices(cfg())[0] == "torch_compile: auto compiles on CUDA only; this run trains on cpu"
    plan = plan_optimizations(cfg(), CUDA)
    assert plan.names == ALWAYS + ["compile"] and plan.skipped == []
    assert plan.decided.compile_why == "torch_compile: auto: on, training on CUDA (regional)"


def test_compile_is_planned_and_auto_is_skipped_off_cuda_with_the_reason():
    assert plan_optimizations(cfg(torch_compile=True), CPU).names == ALWAYS + ["compile"]
    assert plan_optimizations(cfg(torch_compile="auto"), CUDA).names == ALWAYS + ["compile"]
    plan = plan_optimizations(cfg(torch_compile="auto"), CPU)
    assert plan.names == ALWAYS and plan.skipped == [
        {
            "name": "compile",
            "switch": "performance.torch_compile",
            "reason": "torch_compile: auto compiles on CUDA only; this run trains on cpu",
        }
    ]
    assert "skipped compile: torch_compile: auto compiles on CUDA only" in plan.describe()


def test_the_fixed_order_is_attention_experts_tiled_mlp_loss_checkpointing_tiled_layers_compile_context_then_data_parallel():
    assert [t.name for t in TRANSFORMS] == [
        "allocator",
        "attention",
        "quantize",
        "experts",
        "expert_parallel",
        "fp8",
        "fused_lora_linear",
        "tiled_mlp",
        "loss",
        "activation_checkpointing",
        "tiled_layers",
        "layer_runs",
        "compile",
        "context_parallel",
        "ddp",
        "fsdp",
    ]


def test_attention_the_device_cannot_run_is_refused_by_the_plan():
    with pytest.raises(PlanError, match="'flex_attention' has no backward pass on the CPU"):
        plan_optimizations(
            parse_config({**_RAW, "model": {"preset": "tiny-llama", "attn_implementation": "flex_attention"}}), CPU
        )


def test_compiled_flex_attention_with_heads_narrower_than_16_is_refused_on_the_gpu():
    def flex(head_dim, **performance):
        model = {"preset": "tiny-llama", "attn_implementation": "flex_attention", "preset_overrides": {"head_dim": head_dim}}
        return parse_config({**_RAW, "model": model, "performance": performance})

    gpu = RunFacts(torch.device("cuda"))
    with pytest.raises(
        PlanError, match=r"flex_attention compiled by Inductor needs heads of at least 16, but this model's are 8"
    ):
        plan_optimizations(flex(8), gpu)
    for fine in (flex(16), flex(8, torch_compile=False), flex(8, torch_compile_backend="aot_eager")):
        plan_optimizations(fine, gpu)


def test_cudagraphs_need_cuda_and_one_shape():
    options = {"triton.cudagraphs": True}
    with pytest.raises(PlanError, match="need a CUDA device"):
        plan_optimizations(cfg(torch_compile=True, torch_compile_options=options), CPU)
    with pytest.raises(PlanError) as info:
        plan_optimizations(cfg(torch_compile=True, torch_compile_mode="reduce-overhead"), VARYING)
    message = str(info.value)
    assert "torch_compile_mode 'reduce-overhead' uses CUDA graphs" in message and "3 to 9 tokens" in message
    assert "max-autotune-no-cudagraphs" in message
    assert plan_optimizations(cfg(torch_compile=True, torch_compile_options=options), CUDA).names == ALWAYS + ["compile"]


def test_cudagraphs_beside_fsdp2_are_refused_whatever_asks_for_them():
    """FSDP2 gathers a layer's parameters into new memory every step: graphs would be recorded
    again every step (measured with expert parallelism; the gathering is FSDP2's own)."""
    from hone.runtime.world import World

    two = RunFacts(torch.device("cuda"), world=World(0, 2, 0))
    fsdp = {"distributed": {"strategy": "fsdp"}}
    for performance, source in (
        ({"torch_compile": True, "cuda_graphs": True}, "performance.cuda_graphs: true"),
        ({"torch_compile": True, "torch_compile_mode": "reduce-overhead"}, "torch_compile_mode 'reduce-overhead'"),
    ):
        with pytest.raises(PlanError) as info:
            plan_optimizations(parse_config({**_RAW, **fsdp, "performance": performance}), two)
        assert f"{source} uses CUDA graphs, which cannot replay beside distributed.strategy: fsdp" in str(info.value)
    auto = plan_optimizations(parse_config({**_RAW, **fsdp, "performance": {"torch_compile": True}}), two)
    assert auto.decided.cuda_graphs is False and "FSDP2 gathers each layer's parameters" in auto.decided.cuda_graphs_why
    ddp = {"distributed": {"strategy": "ddp"}, "performance": {"torch_compile": True, "cuda_graphs": True}}
    assert "compile" in plan_optimizations(parse_config({**_RAW, **ddp}), two).names  # not refused beside DDP


def _transform(name, log, conflicts=(), stage="adapted"):
    return Transform(
        name=name,
        switch=f"performance.{name}",
        wanted=lambda ctx: True,
        model=lambda model, ctx: log.append(name) or {"n": len(log)},
        conflicts=conflicts,
        stage=stage,
    )


def test_transforms_apply_stage_by_stage_in_the_fixed_order_and_conflicts_are_refused():
    log = []
    order = (_transform("first", log), _transform("early", log, stage="base"), _transform("second", log))
    plan = plan_optimizations(cfg(), CPU, order)
    assert [a.name for a in plan.apply(nn.Linear(1, 1), "base", cfg(), CPU)] == ["early"]
    applied = plan.apply(nn.Linear(1, 1), "adapted", cfg(), CPU)
    assert log == ["early", "first", "second"] and [a.details["n"] for a in applied] == [2, 3]
    assert [a.name for a in plan.in_order()] == ["first", "early", "second"]  # the record keeps plan order
    with pytest.raises(PlanError, match=r"performance.b \(b\) cannot be combined with a"):
        plan_optimizations(cfg(), CPU, (_transform("a", log), _transform("b", log, conflicts=("a",))))


def test_hooks_collect_step_contexts_and_after_step_actions_in_plan_order(tokenizer):
    from contextlib import contextmanager

    events = []

    @contextmanager
    def around(tag, batch):
        events.append(f"enter {tag}")
        yield
        events.append(f"exit {tag}")

    extra = (
        Transform(
            "a",
            "x.a",
            lambda ctx: True,
            step_context=lambda m, ctx: lambda b: around("a", b),
            after_optimizer_step=lambda m: events.append("after a"),
        ),
        Transform("b", "x.b", lambda ctx: True, step_context=lambda m, ctx: lambda b: around("b", b)),
    )
    plan = plan_optimizations(cfg(), CPU, TRANSFORMS + extra)
    hooks = plan.hooks(tiny_model("tiny-llama", tokenizer), cfg(), CPU)
    with hooks.step_context(None):
        events.append("step")
    hooks.after_optimizer_step()
    assert events == ["enter a", "enter b", "step", "exit b", "exit a", "after a"]
    assert hooks.layout.kind == "dense_mask" and callable(hooks.loss_fn)


def test_record_lists_applied_in_plan_order_then_skipped_then_compile_counts(tmp_path, tokenizer):
    config = cfg(torch_compile="auto")
    plan = plan_optimizations(config, CPU)
    model = tiny_model("tiny-llama", tokenizer)
    plan.apply(model, "base", config, CPU)
    plan.apply(model, "adapted", config, CPU)
    plan.hooks(model, config, CPU)
    path = write_record(tmp_path, plan, {"recompiles": 0})
    record = json.loads(path.read_text())
    assert path.name == OPTIMIZATIONS_FILE and [a["name"] for a in record["applied"]] == ALWAYS
    assert record["applied"][2]["details"]["loss"] == "fused_linear_ce"
    assert record["applied"][0]["details"]["packed_batches_carry"] == "dense_mask"
    assert record["skipped"][0]["name"] == "compile" and record["compile"] == {"recompiles": 0}
    assert plan.describe().startswith(
        "optimizations: attention (sdpa, causal, no mask prepared), fused_lora_linear (0 layers), loss (fused_linear_ce); "
        "skipped compile"
    )


@pytest.mark.parametrize(("preset", "layers"), [("tiny-llama", 2), ("tiny-gemma", 2), ("tiny-qwen3-moe", 2)])
def test_decoder_layers_are_found_through_the_peft_wrapper(tokenizer, preset, layers):
    model = apply_adapter(tiny_model(preset, tokenizer), AdapterConfig())
    found = decoder_layers(model)
    assert len(found) == layers and all(type(layer).__name__.endswith("DecoderLayer") for layer in found)


def test_regional_compile_keeps_the_module_tree_and_state_dict_keys(tokenizer):
    model = apply_adapter(tiny_model("tiny-qwen3", tokenizer), AdapterConfig())
    keys = list(model.state_dict())
    details = compile_regional(model, PerformanceConfig(torch_compile=True, torch_compile_backend="eager"), dynamic=False)
    assert details["layers"] == 2 and details["first_layer_input_requires_grad"] is True
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(model))
    assert list(model.state_dict()) == keys  # no _orig_mod: adapters and checkpoints save as before


def test_regional_compile_without_decoder_layers_says_what_to_use_instead():
    from hone.transforms.compile import CompileError

    with pytest.raises(CompileError, match="torch_compile_scope: model"):
        compile_regional(nn.Linear(2, 2), PerformanceConfig(torch_compile=True), dynamic=False)


def test_shape_note_tells_fixed_from_varying_lengths():
    from types import SimpleNamespace

    config = cfg()
    assert shape_note(config, SimpleNamespace(train=SimpleNamespace(min_length=8, max_length=8))) is None
    note = shape_note(config, SimpleNamespace(train=SimpleNamespace(min_length=3, max_length=9)))
    assert "3 to 9 tokens" in note and "padded" in note and "data.sample_packing or data.pad_to_sequence_len" in note
    packed = parse_config(
        {"model": {"preset": "tiny-llama"}, "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca"}], "sample_packing": True}}
    )
    varied = SimpleNamespace(train=SimpleNamespace(min_length=3, max_length=9))
    assert shape_note(packed, varied) is None  # rows sequence_len wide; boundaries take one count under graphs


def test_compile_event_tells_recompiles_from_new_frames():
    assert CompileEvent("0/1", "forward", 2, True).compiled_before
    assert not CompileEvent("3/0", "forward", 2, True).compiled_before
    assert CompileEvent("!1/0/2", "forward", 2, True).frame == "!1/0"


def test_a_frame_an_earlier_run_compiled_is_not_a_recompile_of_this_run():
    """Two runs in one process: the second run's first compile of a frame is ``0/1`` (Dynamo's
    cache outlives the first run) but only a second compile of it in this run is a recompile."""
    watch = CompileWatch(lambda message: None)
    watch.events += [CompileEvent("0/1", "forward", 1, False), CompileEvent("5/0", "forward", 1, False)]
    assert watch.summary()["recompiles"] == 0
    watch.events.append(CompileEvent("0/2", "forward", 3, True))
    assert watch.summary()["recompiles"] == 1


def test_watch_warns_about_late_compiles_only_and_caps_its_warnings(monkeypatch):
    warnings = []
    watch = CompileWatch(warnings.append)
    monkeypatch.setattr("hone.transforms.watch.recompile_reasons", lambda ids: {i: "size mismatch at index 1" for i in ids})

    class Args:
        def __init__(self, trigger, compile_id):
            self.callback_trigger = type("T", (), {"name": trigger})()
            self.compile_id = compile_id

    watch._on_compile_end(Args("DYNAMO", "0/0"))
    watch._on_compile_end(Args("LAZY_BACKWARD", "0/0"))
    watch.on_step(1, 12.5)  # the cold start: no warning
    assert warnings == [] and watch.first_step_s == 12.5
    for step in range(2, 7):
        watch._on_compile_end(Args("DYNAMO", f"0/{step - 1}"))
        watch.on_step(step, 0.1)
    assert len(warnings) == 3 and "step 2: torch.compile compiled again" in warnings[0]
    assert "size mismatch at index 1" in warnings[0] and "only counted" in warnings[-1]
    stats = watch.summary()
    assert stats["forward_graphs"] == 6 and stats["backward_graphs"] == 1 and stats["recompiles"] == 5
    assert stats["compiles_after_first_step"] == 5 and stats["first_step_s"] == 12.5


def test_watch_counts_cuda_graph_recordings_and_warns_once_when_they_repeat_every_step():
    """One recording per graph in the first steps is the warm-up, an evaluation pass records its
    own graphs once; recordings in two consecutive later steps mean the inputs move every step
    (warned once)."""
    warnings = []
    watch = CompileWatch(warnings.append)

    class Args:
        def __init__(self, trigger, compile_id):
            self.callback_trigger = type("T", (), {"name": trigger})()
            self.compile_id = compile_id

    for step in range(1, 9):
        # the warm-up recording, an evaluation pass's first one (step 4), then once every step from step 6
        if step in (2, 4, 6, 7, 8):
            watch._on_compile_end(Args("CUDAGRAPH_RECORDING", "0/0"))
        watch.on_step(step, 0.1)
    assert len(warnings) == 1 and warnings[0].startswith("steps 6-7: CUDA graphs were recorded again")
    assert "performance.cuda_graphs: false" in warnings[0]
    stats = watch.summary()
    assert stats["graph_recordings"] == 5 and stats["graph_recordings_after_warmup"] == 4
    assert stats["forward_graphs"] == 0 and stats["recompiles"] == 0  # recordings are not compiles
    # a resumed run counts its warm-up from its own first step
    resumed = CompileWatch(warnings.append)
    for step in range(1001, 1004):
        resumed._on_compile_end(Args("CUDAGRAPH_RECORDING", "0/0"))
        resumed.on_step(step, 0.1)
    assert len(warnings) == 1 and resumed.summary()["graph_recordings_after_warmup"] == 0


def test_watch_registers_with_dynamo_and_unregisters():
    from torch._dynamo.callback import callback_handler

    before = len(callback_handler.end_callbacks)
    watch = CompileWatch(lambda m: None).start()
    assert watch.available and len(callback_handler.end_callbacks) == before + 1
    watch.stop()
    assert len(callback_handler.end_callbacks) == before


def test_checkpointing_auto_picks_the_fastest_policy_that_fits_the_card_and_says_why():
    from hone.transforms.memory.estimate import estimate_memory
    from hone.transforms.memory.knobs import Knobs

    config = parse_config(
        {
            "model": {"preset": "qwen3-8b", "dtype": "bfloat16"},
            "data": {**_RAW["data"], "sequence_len": 8192},
            "memory": {"activation_checkpointing": "auto"},
        }
    )  # an 8B config: planned on the meta device, nothing allocated
    est = {p: estimate_memory(config, Knobs(p, "fused_linear_ce", device="cpu")).total for p in ("none", "selective", "full")}
    assert est["full"] < est["none"]
    roomy = plan_optimizations(config, RunFacts(torch.device("cpu"), memory_bytes=10 * est["none"]))
    assert "activation_checkpointing" not in roomy.names  # auto chose none: nothing to apply
    assert (
        roomy.skipped[0]["name"] == "activation_checkpointing"
        and "none: the fastest policy that fits" in roomy.skipped[0]["reason"]
    )
    from hone.transforms.planner import decisions

    assert est["full"] < est["selective"] < est["none"]
    tight = RunFacts(torch.device("cpu"), memory_bytes=int(est["full"] / 0.85))  # fits full (10% margin) only
    assert "activation_checkpointing" in plan_optimizations(config, tight).names
    why = {name: why for name, _, _, why in decisions(config, tight)}["activation_checkpointing"]
    assert why.startswith("activation_checkpointing: auto on a ") and "full: the fastest policy that fits" in why
