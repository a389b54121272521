"""Layer-run checkpointing (``memory.checkpoint_run_layers``): one saved input per run of k decoder
layers, the run's inner inputs rebuilt in the backward. The losses and every gradient equal those
of no checkpointing (fp32, CPU) for runs that do not divide the layers, under ``full`` and
``offload``, with tiled layers and the tiled MLP, LoRA and full fine-tuning, Llama and Qwen3; the
inner inputs are not kept between the forward and the backward, and the rebuilt ones are exactly
the forward's."""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from hone.config import parse_config
from hone.models.attention.causal import register_causal_sdpa
from hone.models.structure import decoder_layers
from hone.testing import offload_step, tiny_model, with_random_lora
from hone.transforms.checkpointing import apply_activation_checkpointing, offloader_for
from hone.transforms.layer_runs import LayerRuns, LayerRunsError, RunLayer, apply_layer_runs, layer_runs_for, run_bounds
from hone.transforms.tiled_layers import apply_tiled_layers
from hone.transforms.tiled_mlp import apply_tiled_mlp

LAYERS = 5  # divisible by neither 2 nor 3: the last run is shorter
BATCH, ROW = 2, 23


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(preset: str, adapter: str, tokenizer, layers: int = LAYERS) -> nn.Module:
    model = tiny_model(preset, tokenizer, seed=11, num_hidden_layers=layers)
    model.set_attn_implementation(register_causal_sdpa())
    if adapter == "lora":
        with torch.random.fork_rng(devices=[]):  # PEFT draws the A matrices from the global RNG
            torch.manual_seed(12)
            model = with_random_lora(model, seed=13)
    return model.train()


def _in_runs(model: nn.Module, k: int, policy: str = "full", chunks: int = 0, shards: int = 0, split=None) -> nn.Module:
    """A copy of ``model`` as the planner builds it: tiled MLP, checkpointing, tiled layers, runs."""
    copied = copy.deepcopy(model)
    if shards:
        apply_tiled_mlp(copied, shards)
    apply_activation_checkpointing(copied, policy, offload_min_bytes=1, use_streams=False, offload_layers=split)
    if chunks:
        apply_tiled_layers(copied, chunks)
    apply_layer_runs(copied, k)
    return copied


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(5, 300, (BATCH, ROW), generator=torch.Generator().manual_seed(seed))


def _assert_same(got, want, rtol: float = 1e-5) -> None:
    (loss, grads), (loss_ref, ref) = got, want
    torch.testing.assert_close(loss, loss_ref, rtol=rtol, atol=0)
    assert grads.keys() == ref.keys() and len(ref) > 3
    for name, g in ref.items():
        scale = g.abs().max()
        assert scale > 0, f"{name}: a zero gradient cannot tell right from wrong"
        err = (grads[name] - g).abs().max() / scale
        assert err <= rtol, f"{name}: relative difference {err:.2e}"


def _runs_count(k: int) -> int:
    return len(run_bounds(LAYERS, k))


def test_runs_cover_the_layers_in_order_with_a_shorter_last_one():
    assert run_bounds(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert run_bounds(5, 3) == [(0, 3), (3, 5)]
    assert run_bounds(4, 4) == [(0, 4)] and run_bounds(3, 8) == [(0, 3)]
    with pytest.raises(ValueError, match="at least one layer"):
        run_bounds(4, 0)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("adapter", ["lora", "full"])
@pytest.mark.parametrize("policy", ["full", "offload"])
@pytest.mark.parametrize("k", [2, 3])
def test_runs_give_the_losses_and_gradients_of_no_checkpointing(preset, adapter, policy, k, tokenizer):
    model = _model(preset, adapter, tokenizer)
    ids = _ids(20 + k)
    want = offload_step(copy.deepcopy(model), ids)
    runs = _in_runs(model, k, policy)
    _assert_same(offload_step(runs, ids), want)
    stats = layer_runs_for(runs).stats
    assert stats.first_saved == stats.rebuilds == _runs_count(k)
    assert stats.inner_dropped == stats.rebuilt_layers == LAYERS - _runs_count(k)
    if policy == "offload":  # the offloader sees the runs' first inputs only (under LoRA run 0's is a leaf it keeps)
        assert offloader_for(runs).stats.packed == _runs_count(k) - (adapter == "lora")
    _assert_same(offload_step(runs, _ids(40 + k)), offload_step(copy.deepcopy(model), _ids(40 + k)))  # a second step


@pytest.mark.parametrize("adapter", ["lora", "full"])
@pytest.mark.parametrize(("k", "chunks", "shards"), [(2, 3, 0), (3, 0, 2), (2, 2, 3)])
def test_runs_compose_with_tiled_layers_and_the_tiled_mlp(adapter, k, chunks, shards, tokenizer):
    model = _model("tiny-qwen3", adapter, tokenizer)
    ids = _ids(50 + k)
    want = offload_step(copy.deepcopy(model), ids)
    for policy in ("full", "offload"):
        runs = _in_runs(model, k, policy, chunks=chunks, shards=shards)
        _assert_same(offload_step(runs, ids), want)
        assert layer_runs_for(runs).stats.rebuilt_layers == LAYERS - _runs_count(k)


@pytest.mark.parametrize("split", [0, 1, 2])
def test_offload_layers_counts_runs(split, tokenizer):
    model = _model("tiny-llama", "full", tokenizer)
    ids = _ids(60)
    runs = _in_runs(model, 2, "offload", split=split)
    _assert_same(offload_step(runs, ids), offload_step(copy.deepcopy(model), ids))
    assert offloader_for(runs).stats.packed == split  # runs' first inputs, the first ones


def _first_pass(seen: list[torch.Tensor], x: torch.Tensor) -> None:
    if len(seen) < LAYERS:  # the forward's calls; the rebuild's come later
        seen.append(x.detach().clone())


def _forward_inputs(model: nn.Module) -> list[torch.Tensor]:
    """The input each decoder layer got in the last training forward (filled by pre-hooks on the
    layers the runs wrap)."""
    seen: list[torch.Tensor] = []
    for layer in decoder_layers(model):
        layer.inner.register_forward_pre_hook(lambda _m, args: _first_pass(seen, args[0]))
    return seen


def test_the_rebuilt_inner_inputs_are_exactly_the_forwards(tokenizer, monkeypatch):
    model = _in_runs(_model("tiny-qwen3", "lora", tokenizer), 3)
    forward = _forward_inputs(model)
    rebuilt: dict[int, torch.Tensor] = {}
    rebuild = LayerRuns._rebuild

    def spy(self, run):
        rebuild(self, run)
        rebuilt.update({run.start + i: t.clone() for i, t in run.rebuilt.items()})

    monkeypatch.setattr(LayerRuns, "_rebuild", spy)
    offload_step(model, _ids(70))
    assert sorted(rebuilt) == list(range(LAYERS)) and len(forward) == LAYERS
    for i in range(LAYERS):
        assert torch.equal(rebuilt[i], forward[i]), f"layer {i}"


def test_gradients_tell_a_wrong_rebuild(tokenizer, monkeypatch):
    """The parity check can fail: a rebuild that hands a layer the wrong input (here the run's first
    input for every layer) gives other gradients."""
    model = _model("tiny-llama", "lora", tokenizer)
    ids = _ids(80)
    want = offload_step(copy.deepcopy(model), ids)
    rebuild = LayerRuns._rebuild

    def wrong(self, run):
        rebuild(self, run)
        run.rebuilt = {i: run.rebuilt[0] for i in run.rebuilt}

    monkeypatch.setattr(LayerRuns, "_rebuild", wrong)
    with pytest.raises(AssertionError, match="relative difference|Tensor-likes"):
        _assert_same(offload_step(_in_runs(model, 2), ids), want)


def test_the_inner_inputs_are_not_kept_between_the_forward_and_the_backward(tokenizer):
    def alive_after_forward(model: nn.Module) -> list[bool]:
        refs: list[weakref.ref] = []
        for layer in decoder_layers(model):
            inner = layer.inner if isinstance(layer, RunLayer) else layer
            inner.register_forward_pre_hook(lambda _m, args: refs.append(weakref.ref(args[0])) if len(refs) < LAYERS else None)
        from hone.transforms.checkpointing import offload_step_context

        with offload_step_context(model):
            loss = model(input_ids=_ids(90), labels=_ids(90), use_cache=False).loss
            gc.collect()
            alive = [r() is not None for r in refs]
            loss.backward()
        return alive

    model = _model("tiny-llama", "full", tokenizer)
    checkpointed = copy.deepcopy(model)
    apply_activation_checkpointing(checkpointed, "full", use_streams=False)
    assert alive_after_forward(checkpointed) == [True] * LAYERS  # every layer's input saved
    assert alive_after_forward(_in_runs(model, 2)) == [True, False, True, False, True]
    assert alive_after_forward(_in_runs(model, 3)) == [True, False, False, True, False]


def test_dropout_masks_of_the_forward_are_reproduced_by_the_rebuild(tokenizer):
    """Attention dropout inside the rebuilt layers: the rebuild replays each layer's RNG state, so
    the gradients are those of the plain checkpointed layers drawing the same masks."""
    model = _model("tiny-llama", "full", tokenizer)
    for layer in decoder_layers(model):
        layer.self_attn.attention_dropout = 0.3
    ids = _ids(95)
    reference = copy.deepcopy(model)
    apply_activation_checkpointing(reference, "full", use_streams=False)
    torch.manual_seed(7)
    want = offload_step(reference, ids)
    runs = _in_runs(model, 3)
    torch.manual_seed(7)
    _assert_same(offload_step(runs, ids), want)


def test_without_a_training_step_it_is_the_layers_own_call(tokenizer):
    model = _model("tiny-qwen3", "lora", tokenizer)
    runs = _in_runs(model, 2)
    ids = _ids(96)
    with torch.no_grad():
        torch.testing.assert_close(runs(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-6, atol=1e-6)
    assert [n for n, _ in runs.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert runs.state_dict().keys() == model.state_dict().keys()


def test_something_between_the_layers_is_refused_rather_than_rebuilt_wrongly(tokenizer):
    """A run rebuilds layer j's input as layer j-1's output: where the model changes it in between
    (here a pre-hook scaling layer 1's input), the rebuild would be wrong, so the forward refuses."""
    from hone.transforms.checkpointing import offload_step_context

    model = _in_runs(_model("tiny-llama", "full", tokenizer), 2)
    decoder_layers(model)[1].register_forward_pre_hook(lambda _m, args: (args[0] * 1.5, *args[1:]))
    with offload_step_context(model), pytest.raises(LayerRunsError, match="did not receive the output of layer 0"):
        model(input_ids=_ids(97), labels=_ids(97), use_cache=False)
    with pytest.raises(ValueError, match="2 or more"):
        apply_layer_runs(copy.deepcopy(_model("tiny-llama", "full", tokenizer)), 1)


@pytest.mark.usefixtures("fresh_dynamo")
def test_regional_compile_compiles_the_innermost_layer_with_equal_gradients_and_no_recompile(tokenizer):
    import torch._dynamo.utils as dynamo_utils

    from hone.config.performance import PerformanceConfig
    from hone.transforms.compile import compile_regional

    model = _model("tiny-qwen3", "lora", tokenizer, layers=3)
    ids = _ids(98)
    want = offload_step(copy.deepcopy(model), ids)
    for chunks in (2, 0):  # nested stand-ins (a run around a tiled layer) compile the layer inside both
        runs = copy.deepcopy(model)
        apply_activation_checkpointing(runs, "full", use_streams=False)
        if chunks:
            apply_tiled_layers(runs, chunks)
        apply_layer_runs(runs, 2)
        compile_regional(runs, PerformanceConfig(torch_compile=True, torch_compile_backend="aot_eager"), dynamic=False)
        innermost = [layer.inner.inner if chunks else layer.inner for layer in decoder_layers(runs)]
        assert all(m._compiled_call_impl is not None for m in innermost)
        assert all(getattr(layer, "_compiled_call_impl", None) is None for layer in decoder_layers(runs))
    # the checkpoint traced into the compiled layer saves the layer's input: the runs' hooks recognise
    # it; the rebuild runs the graphs the forward compiled (its inputs require grad as the forward's)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _assert_same(offload_step(runs, ids), want)
        assert layer_runs_for(runs).stats.inner_dropped == layer_runs_for(runs).stats.rebuilt_layers == 1
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        _assert_same(offload_step(runs, ids), want)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


# ------------------------------------------------------------------------------ config and plan


def _cfg(memory: dict, **sections):
    raw = {
        "model": {"preset": "tiny-llama"},
        "data": {"datasets": [{"path": "unused.jsonl", "type": "pretokenized"}], "sequence_len": 64},
        "memory": memory,
        **sections,
    }
    return parse_config(raw)


@pytest.mark.parametrize(("value", "want"), [("auto", None), (1, 1), (2, 2), ("3", 3)])
def test_good_run_lengths(value, want):
    assert _cfg({"checkpoint_run_layers": value}).memory.run_layers == want


@pytest.mark.parametrize(
    ("memory", "message"),
    [
        ({"checkpoint_run_layers": 0}, "0 layers per run is not a run; allowed: auto"),
        ({"checkpoint_run_layers": "two"}, "'two' is not a number of layers per run"),
        ({"checkpoint_run_layers": True}, "True is not a number of layers per run"),
        (
            {"checkpoint_run_layers": 2, "activation_checkpointing": "selective"},
            "memory.checkpoint_run_layers: 2 needs memory.activation_checkpointing: full or offload",
        ),
        ({"checkpoint_run_layers": 2, "activation_checkpointing": "none"}, "got none"),
    ],
)
def test_bad_run_lengths_are_refused_naming_the_keys(memory, message):
    from hone.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match=message):
        _cfg(memory)


def test_the_plan_refuses_what_runs_cannot_compose_with():
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import PlanError, plan_optimizations

    cfg = _cfg(
        {"checkpoint_run_layers": 2, "activation_checkpointing": "full"},
        performance={"torch_compile": True, "torch_compile_scope": "model"},
    )
    with pytest.raises(PlanError, match="checkpoint_run_layers: 2: layer runs need torch_compile_scope: regional"):
        plan_optimizations(cfg, RunFacts(torch.device("cpu")))
    ok = plan_optimizations(_cfg({"checkpoint_run_layers": 2, "activation_checkpointing": "full"}), RunFacts(torch.device("cpu")))
    assert "layer_runs" in ok.names and ok.decided.run_layers == 2


def test_the_planner_applies_runs_after_checkpointing_and_they_train_like_no_checkpointing(tokenizer, tmp_path):
    from hone.testing import tiny_config
    from hone.transforms.base import PlanContext, RunFacts
    from hone.transforms.checkpointing import CHECKPOINTING
    from hone.transforms.decide import decide
    from hone.transforms.layer_runs import LAYER_RUNS

    cfg = tiny_config(
        tmp_path,
        memory={"activation_checkpointing": "offload", "checkpoint_run_layers": 2, "offload_layers": 1},
        model={"preset_overrides": {"num_hidden_layers": LAYERS}},
    )
    facts = RunFacts(torch.device("cpu"), host_memory_bytes=1 << 40)
    model = _model("tiny-llama", "full", tokenizer)
    planned = copy.deepcopy(model)
    ctx = PlanContext(cfg, facts, decide(cfg, facts))
    CHECKPOINTING.model(planned, ctx)
    details = LAYER_RUNS.model(planned, ctx)
    assert details["layers_per_run"] == 2 and details["runs"] == 3 and details["offloaded_runs"] == 1
    assert details["why"] == "memory.checkpoint_run_layers: 2"
    ids = _ids(99)
    _assert_same(offload_step(planned, ids), offload_step(copy.deepcopy(model), ids))
    assert offloader_for(planned).max_tensors == 1  # (its 1 MiB floor offloads nothing of a tiny model)


class _ToyLayer(nn.Module):
    """A layer whose matmul saves a view of its input (``x.view(-1, hidden)``), as a compiled
    layer's graph may: the runs' hooks recognise the input's memory and rebuild the view."""

    def __init__(self, hidden: int, seed: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(seed)) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh((x.view(-1, x.shape[-1]) @ self.w).view_as(x)) + x


class _Toy(nn.Module):
    _no_split_modules = ["_ToyLayer"]

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ToyLayer(8, seed) for seed in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_saved_view_of_a_layer_input_is_rebuilt_as_that_view():
    toy = _Toy()
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(5), requires_grad=True)
    toy(x).square().sum().backward()
    want = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in toy.named_parameters()}}
    runs, x.grad = copy.deepcopy(toy), None
    runs.zero_grad(set_to_none=True)
    apply_layer_runs(runs, 2)
    with layer_runs_for(runs).step_context():
        runs(x).square().sum().backward()
    got = {"x": x.grad, **{n: p.grad for n, p in runs.named_parameters()}}
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    stats = layer_runs_for(runs).stats
    assert stats.inner_dropped == stats.rebuilt_layers == 2 and stats.first_saved == 0  # (run firsts: kept as x itself)


def test_a_training_run_through_the_planner_records_runs_and_trains_like_one_input_per_layer(tmp_path, write_jsonl):
    """``hone train``'s path (tiny Qwen3 of 3 layers, LoRA, tiled layers inside): the runs are
    applied after checkpointing and tiled layers, recorded with why, and train alike."""
    from hone.testing import tiny_lora_run

    gen = torch.Generator().manual_seed(6)
    rows = []
    for _ in range(8):
        ids = torch.randint(5, 300, (31,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 4 + ids[4:]})
    data = write_jsonl(tmp_path, rows)
    model = {"preset_overrides": {"num_hidden_layers": 3}}
    memory = {"tiled_layers": 2}
    plain, plain_record = tiny_lora_run(
        data, tmp_path / "plain", model=model, memory={**memory, "checkpoint_run_layers": 1}, performance={"loss": "standard"}
    )
    steps, record = tiny_lora_run(
        data, tmp_path / "runs", model=model, memory={**memory, "checkpoint_run_layers": 2}, performance={"loss": "standard"}
    )
    assert "layer_runs" not in [a["name"] for a in plain_record["applied"]]
    names = [a["name"] for a in record["applied"]]
    assert names.index("activation_checkpointing") < names.index("tiled_layers") < names.index("layer_runs")
    details = next(a for a in record["applied"] if a["name"] == "layer_runs")["details"]
    assert details["layers_per_run"] == 2 and details["runs"] == 2 and details["why"] == "memory.checkpoint_run_layers: 2"
    assert len(steps) == 2
    torch.testing.assert_close(torch.tensor(steps), torch.tensor(plain), rtol=1e-5, atol=0)
