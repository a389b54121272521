"""Tiled decoder layers (issue 14): the same outputs and gradients as the untiled checkpointed
layer, in fp32 on CPU, for tiny Qwen3 and Llama models (GQA: 4 query heads, 2 key heads), LoRA
on q, k, v, o and the MLP, and full fine-tune; under the offload policy, with a tiled MLP inside,
under regional compile, and through the planner in a training run; each parameter's gradient
produced once per backward; the dropout masks of the forward reproduced in the recompute; and
the refusals (config, plan, runtime).

The reference is always the same model, untiled, under the same checkpointing policy (a deep copy,
the same weights), through the same forward and loss. Rows of 29 tokens, two per micro-batch:
2 chunks are 15 + 14 tokens, 3 are 10 + 10 + 9, 7 are 5 x 5 + 4 (six chunks: uneven).
"""

import copy

import pytest
import torch
from torch import nn

from hone.config import ConfigError, parse_config
from hone.config.adapter import AdapterConfig
from hone.models.adapters import apply_adapter
from hone.models.attention.causal import register_causal_sdpa
from hone.models.attention.tiled import TILED_SDPA, causal_chunk_attention
from hone.models.structure import decoder_layers
from hone.testing import counting_grad_accumulations, hook_count, offload_step, tiny_lora_run, tiny_model, with_random_lora
from hone.transforms.base import RunFacts
from hone.transforms.checkpointing import apply_activation_checkpointing, offloader_for
from hone.transforms.tiled_layers import TiledDecoderLayer, TiledLayersError, apply_tiled_layers, chunk_bounds
from hone.transforms.tiled_mlp import TiledMLP, apply_tiled_mlp

RTOL = 1e-5
BATCH, ROW = 2, 29


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread is much faster than two
    threads spinning against other processes' load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(preset: str, adapter: str, tokenizer, **overrides) -> nn.Module:
    """A tiny model attending through hone's causal sdpa (what the attention transform picks for
    an unpacked sdpa run), with random-B LoRA on every linear or none."""
    model = tiny_model(preset, tokenizer, seed=1, **overrides)
    model.set_attn_implementation(register_causal_sdpa())
    if adapter == "lora":  # q, k, v, o and the MLP's gate, up and down projections
        with torch.random.fork_rng(devices=[]):  # PEFT draws the A matrices from the global RNG
            torch.manual_seed(3)
            model = with_random_lora(model, seed=2)
    return model


def _checkpointed(model: nn.Module, policy: str = "full") -> nn.Module:
    copied = copy.deepcopy(model)
    apply_activation_checkpointing(copied, policy, offload_min_bytes=1, use_streams=False)
    return copied


def _tiled(model: nn.Module, chunks: int, policy: str = "full") -> nn.Module:
    copied = _checkpointed(model, policy)
    apply_tiled_layers(copied, chunks)
    return copied


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(5, 300, (BATCH, ROW), generator=torch.Generator().manual_seed(seed))


def _run(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Logits, loss and the gradients of every trainable parameter and of the input embeddings."""
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    out = model(inputs_embeds=embeds, labels=ids, use_cache=False)
    out.loss.backward()
    # (an untied input embedding gets none: the embeddings go in as inputs)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return {"logits": out.logits.detach(), "loss": out.loss.detach(), "input": embeds.grad.clone(), **grads}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and len(want) > 3
    for name, ref in want.items():
        scale = ref.abs().max().item()
        assert scale > 0, f"{name}: a zero gradient cannot tell right from wrong"
        torch.testing.assert_close(got[name], ref, rtol=0, atol=RTOL * scale, msg=lambda m: f"{name}: {m}")


def _inner_calls(model: nn.Module) -> list[int]:
    """A counter of the calls of the first tiled layer's inner layer (one per chunk pass)."""
    calls = [0]
    decoder_layers(model)[0].inner.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


# ------------------------------------------------------------------------------ the chunks


def test_chunks_are_ceil_sized_with_a_shorter_last_one():
    assert chunk_bounds(29, 2) == [(0, 15), (15, 29)]
    assert chunk_bounds(29, 3) == [(0, 10), (10, 20), (20, 29)]
    assert chunk_bounds(29, 7) == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 25), (25, 29)]
    assert chunk_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("gqa", [True, False])
def test_a_chunk_attends_to_every_earlier_key_as_the_whole_row_does(gqa):
    """The chunk attention (lower-right causal, GQA kept) is the rows of the full attention."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 13, 8, generator=gen)
    k, v = (torch.randn(2, 2 if gqa else 4, 13, 8, generator=gen) for _ in range(2))
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    for s, e in chunk_bounds(13, 3):
        part = causal_chunk_attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e])
        torch.testing.assert_close(part, full[:, :, s:e], rtol=RTOL, atol=1e-6)


# ------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("chunks", [2, 3, 7])
@pytest.mark.parametrize("adapter", ["lora", "full"])
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_tiled_equals_the_checkpointed_layer_outputs_and_every_gradient(tokenizer, preset, adapter, chunks):
    model = _model(preset, adapter, tokenizer)
    reference = _checkpointed(model)
    tiled = _tiled(model, chunks)
    layers = decoder_layers(tiled)
    assert len(layers) == 2 and all(isinstance(layer, TiledDecoderLayer) for layer in layers)
    assert tiled.config._attn_implementation == TILED_SDPA
    calls = _inner_calls(tiled)
    ids = _ids()
    want = _run(reference, ids)
    if adapter == "lora":  # the adapters of the attention and the MLP train
        assert any("k_proj.lora_A" in n for n in want) and any("down_proj.lora_B" in n for n in want)
    got = _run(tiled, ids)
    n = len(chunk_bounds(ROW, chunks))
    assert calls[0] == n + (n - 1) + n  # forward, the backward's key pass, the recompute
    _assert_same(got, want)


def test_parameter_names_and_state_dict_keys_are_unchanged(tokenizer):
    model = _model("tiny-qwen3", "lora", tokenizer)
    tiled = _tiled(model, 3)
    assert list(tiled.state_dict()) == list(model.state_dict())
    assert [n for n, _ in tiled.named_parameters()] == [n for n, _ in model.named_parameters()]
    record = apply_tiled_layers(tiled, 3)  # already tiled: left as it is
    assert record["newly_tiled"] == 0 and record["classes"] == ["Qwen3DecoderLayer"] and record["layers"] == 2


def test_each_parameter_gets_its_gradient_once_per_backward_and_no_hook_stays(tokenizer):
    """Two micro-batches accumulate twice, as untiled ones do (a per-chunk ``.backward()`` would
    accumulate once per chunk), and tiling leaves no hook behind."""
    model = _model("tiny-qwen3", "lora", tokenizer)
    tiled = _tiled(model, 3)
    before = hook_count(tiled)
    reference = _checkpointed(model)
    ids = _ids()
    with counting_grad_accumulations(tiled) as counts:
        for m in (tiled, reference):
            m.zero_grad(set_to_none=True)
            for _ in range(2):  # two micro-batches, accumulated
                m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert counts and set(counts.values()) == {2}, counts
    assert hook_count(tiled) == before
    want = dict(reference.named_parameters())
    for name, param in tiled.named_parameters():
        if param.requires_grad:
            ref = want[name].grad
            torch.testing.assert_close(param.grad, ref, rtol=0, atol=RTOL * ref.abs().max().item())


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_offload_policy_moves_exactly_the_tiled_layers_inputs(tokenizer, adapter):
    """Under ``offload`` the tiled layer's saved input goes through the offloader's hooks as the
    checkpoint's did: the same tensors reach the host, and the gradients are the same."""
    model = _model("tiny-qwen3", adapter, tokenizer)
    reference = _checkpointed(model, "offload")
    tiled = _tiled(model, 3, "offload")
    ids = _ids(1)
    want_loss, want = offload_step(reference, ids)
    want_stats = offloader_for(reference).stats
    loss, got = offload_step(tiled, ids)
    stats = offloader_for(tiled).stats
    assert stats.packed == want_stats.packed >= 1 and stats.shapes == want_stats.shapes
    assert set(stats.shapes) == {(BATCH, ROW, 64)}  # layer inputs only, no chunk's activations
    torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=0)
    _assert_same(got, want)


def test_a_tiled_mlp_inside_the_tiled_layer_composes(tokenizer):
    """Chunks of chunks: the tiled MLP's shards inside each chunk of the layer."""
    model = _model("tiny-qwen3", "lora", tokenizer)
    reference = _checkpointed(model)
    tiled = copy.deepcopy(model)
    apply_tiled_mlp(tiled, 2)
    apply_activation_checkpointing(tiled, "full", use_streams=False)
    apply_tiled_layers(tiled, 3)
    assert all(isinstance(layer.mlp, TiledMLP) for layer in decoder_layers(tiled))
    ids = _ids(2)
    _assert_same(_run(tiled, ids), _run(reference, ids))


def test_without_grad_it_is_the_layers_own_call(tokenizer):
    model = _model("tiny-qwen3", "full", tokenizer)
    tiled = _tiled(model, 3)
    calls = _inner_calls(tiled)
    ids = _ids(3)
    with torch.no_grad():
        torch.testing.assert_close(tiled(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    assert calls[0] == 1  # the whole row at once
    tiled.eval()
    layer = decoder_layers(tiled)[0]
    assert not layer.inner.training and not layer.self_attn.training
    tiled.train()
    assert layer.inner.training and layer.inner.gradient_checkpointing is False  # the wrapper is the checkpoint


_CHAINED: list[tuple[torch.Tensor, torch.Tensor]] = []


def _chained_chunk_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The test's reference for a chunked layer: each chunk attends to the live keys and values
    of every chunk so far (plain autograd through all of them), with the same kernel call."""
    _CHAINED.append((key, value))
    keys = torch.cat([k for k, _ in _CHAINED], dim=2)
    values = torch.cat([v for _, v in _CHAINED], dim=2)
    return causal_chunk_attention(query, keys, values, dropout, scaling).transpose(1, 2).contiguous(), None


def test_dropout_masks_of_the_forward_are_reproduced_in_the_recompute(tokenizer):
    """LoRA dropout and attention dropout draw per chunk; the backward must differentiate the
    output the forward returned. The reference runs the same chunks in the same order from the
    same seed (so the same masks) with plain autograd through every chunk: a recompute that drew
    other masks (or the RNG left where the forward left it) gives other gradients."""
    from transformers import AttentionInterface

    model = tiny_model("tiny-qwen3", tokenizer, seed=1, attention_dropout=0.2)
    model.set_attn_implementation(register_causal_sdpa())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        model = apply_adapter(model, AdapterConfig(type="lora", lora_r=4, lora_dropout=0.3, lora_target_modules="all-linear"))
    gen = torch.Generator().manual_seed(4)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.1
    model.train()
    reference = copy.deepcopy(model)
    AttentionInterface.register("hone_test_chained_chunks", _chained_chunk_attention)
    reference.get_base_model().set_attn_implementation("hone_test_chained_chunks")
    apply_activation_checkpointing(model, "full", use_streams=False)
    apply_tiled_layers(model, 3)

    x = torch.randn(BATCH, ROW, 64, generator=gen, requires_grad=True)
    g = torch.randn(BATCH, ROW, 64, generator=gen)
    positions = torch.arange(ROW)[None]
    rope = model.get_base_model().model.rotary_emb(x, positions)

    def grads(layer: nn.Module, forward) -> list[torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(7)
        out = forward(layer)
        torch.manual_seed(123)  # the backward must not depend on the RNG's state by then
        (out * g).sum().backward()
        trained = [p.grad.clone() for p in layer.parameters() if p.requires_grad]
        return [out.detach(), x.grad.clone(), *trained]

    def tiled(layer: nn.Module) -> torch.Tensor:
        return layer(x, position_embeddings=rope, position_ids=positions, attention_mask=None)

    def chained(layer: nn.Module) -> torch.Tensor:
        _CHAINED.clear()
        outs = [
            layer(
                x[:, s:e], position_embeddings=tuple(t[:, s:e] for t in rope), position_ids=positions[:, s:e], attention_mask=None
            )
            for s, e in chunk_bounds(ROW, 3)
        ]
        _CHAINED.clear()
        return torch.cat(outs, dim=1)

    got = grads(model.get_base_model().model.layers[0], tiled)
    want = grads(reference.get_base_model().model.layers[0], chained)
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=RTOL * b.abs().max().item())
    again = grads(model.get_base_model().model.layers[0], lambda layer: (torch.manual_seed(8), tiled(layer))[1])
    assert (again[0] - got[0]).abs().max() > 1e-3  # the masks matter: another seed, another output


# ------------------------------------------------------------------------------ refusals


def test_a_mask_reaching_a_tiled_layer_is_refused(tokenizer):
    model = _tiled(_model("tiny-qwen3", "full", tokenizer), 2)
    layer = decoder_layers(model)[0]
    x = torch.randn(1, 6, 64, requires_grad=True)
    rope = model.model.rotary_emb(x, torch.arange(6)[None])
    with pytest.raises(TiledLayersError, match="memory.tiled_layers: the decoder layer got an attention mask"):
        layer(x, attention_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool), position_embeddings=rope)


def test_a_sequence_shaped_argument_it_cannot_cut_is_refused(tokenizer):
    model = _tiled(_model("tiny-qwen3", "full", tokenizer), 2)
    layer = decoder_layers(model)[0]
    x = torch.randn(1, 6, 64, requires_grad=True)
    rope = model.model.rotary_emb(x, torch.arange(6)[None])
    with pytest.raises(TiledLayersError, match="got token_weights of shape \\(1, 6\\).*cannot be cut into chunks"):
        layer(x, position_embeddings=rope, token_weights=torch.ones(1, 6))
    with pytest.raises(TiledLayersError, match="position_ids has shape \\(1, 5\\), not 6 positions"):
        layer(x, position_embeddings=rope, position_ids=torch.arange(5)[None])


def test_models_it_cannot_tile_are_refused(tokenizer):
    eager = tiny_model("tiny-qwen3", tokenizer)
    eager.set_attn_implementation("eager")
    with pytest.raises(TiledLayersError, match="needs? model.attn_implementation: sdpa"):
        apply_tiled_layers(eager, 2)
    moe = tiny_model("tiny-qwen3-moe", tokenizer, output_router_logits=True)
    with pytest.raises(TiledLayersError, match="output_router_logits"):
        apply_tiled_layers(moe, 2)


_RAW = {"model": {"preset": "tiny-llama"}, "data": {"datasets": [{"path": "d.jsonl", "type": "pretokenized"}]}}


def _cfg(memory: dict, **sections: dict):
    raw = {**_RAW, **{k: {**_RAW.get(k, {}), **v} for k, v in sections.items()}}
    return parse_config({**raw, "memory": memory})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "true is ambiguous"),
        (1, "1 is not a chunk count that tiles"),
        (0, "0 is not a chunk count"),
        ("some", "'some' is not a tiling"),
        (2.5, "2.5 is not a tiling"),
        (None, "None is not a tiling"),
    ],
)
def test_bad_tiled_layers_values_are_refused_with_what_is_allowed(value, message):
    with pytest.raises(ConfigError) as caught:
        _cfg({"tiled_layers": value, "activation_checkpointing": "full"})
    text = str(caught.value)
    assert "memory.tiled_layers" in text and message in text and "auto, off, or a number of chunks" in text


@pytest.mark.parametrize(
    ("value", "want", "chunks"), [("off", "off", 0), (False, "off", 0), ("auto", "auto", None), (4, 4, 4), ("8", 8, 8)]
)
def test_good_tiled_layers_values(value, want, chunks):
    memory = _cfg({"tiled_layers": value, "activation_checkpointing": "full"}).memory
    assert memory.tiled_layers == want and memory.tiled_layers_chunks == chunks
    assert parse_config(_RAW).memory.tiled_layers == "auto"  # the default: chunked only where whole layers do not fit


@pytest.mark.parametrize(
    ("memory", "sections", "message"),
    [
        ({"activation_checkpointing": "none"}, {}, "needs memory.activation_checkpointing: full or offload"),
        ({"activation_checkpointing": "selective"}, {}, "got selective; allowed: full, offload"),
        ({"activation_checkpointing": "full"}, {"data": {"sample_packing": True}}, "data.sample_packing"),
        ({"activation_checkpointing": "full"}, {"model": {"attn_implementation": "eager"}}, "allowed: sdpa"),
        (
            {"activation_checkpointing": "offload"},
            {"distributed": {"strategy": "fsdp"}},
            "untested under distributed.strategy: fsdp",
        ),
    ],
)
def test_combinations_it_cannot_run_are_refused_by_the_config(memory, sections, message):
    with pytest.raises(ConfigError) as caught:
        _cfg({"tiled_layers": 3, **memory}, **sections)
    assert "memory.tiled_layers: 3" in str(caught.value) and message in str(caught.value)


def test_the_default_auto_falls_back_to_none_where_the_estimate_fails_and_tiled_layers_are_refused(monkeypatch):
    from hone.transforms import auto_policy
    from hone.transforms.planner import PlanError, plan_optimizations

    def broken(*args, **kwargs):
        raise ValueError("cannot read this model")

    monkeypatch.setattr(auto_policy, "decide_memory", broken)
    roomy = RunFacts(torch.device("cpu"), memory_bytes=1 << 40)
    plan = plan_optimizations(_cfg({}), roomy)
    assert plan.decided.checkpointing == "none"
    assert (
        plan.decided.checkpointing_why
        == "activation_checkpointing: auto: none, the memory estimate failed (ValueError: cannot read this model)"
    )
    with pytest.raises(ValueError, match="cannot read this model"):  # written by the user: auto needs the estimate
        plan_optimizations(_cfg({"activation_checkpointing": "auto"}), roomy)
    with pytest.raises(
        PlanError, match="memory.tiled_layers: 3 needs memory.activation_checkpointing full or offload.*resolves to none"
    ):
        plan_optimizations(_cfg({"tiled_layers": 3}), roomy)


def test_auto_checkpointing_keeps_the_input_only_for_explicit_tiled_layers_and_auto_stays_whole_where_the_run_fits():
    from hone.transforms.planner import decisions, plan_optimizations

    cpu = torch.device("cpu")
    roomy = RunFacts(cpu, memory_bytes=1 << 40)  # checkpointing auto picks none here, unless the layers are tiled
    plan = plan_optimizations(_cfg({"tiled_layers": 3, "activation_checkpointing": "auto"}), roomy)
    assert plan.decided.checkpointing == "full" and "tiled_layers: 3 needs full or offload" in plan.decided.checkpointing_why
    assert "tiled_layers" in plan.names
    plan = plan_optimizations(_cfg({"tiled_layers": 3, "activation_checkpointing": "full"}), roomy)
    plan = plan_optimizations(_cfg({"tiled_layers": 3, "activation_checkpointing": "full"}), roomy)
    assert plan.names.index("activation_checkpointing") < plan.names.index("tiled_layers")
    auto = plan_optimizations(_cfg({"tiled_layers": "auto", "activation_checkpointing": "full"}), roomy)
    assert "tiled_layers" not in auto.names and auto.skipped == []  # fitting whole is no news
    why = {name: w for name, _, on, w in decisions(_cfg({"tiled_layers": "auto", "activation_checkpointing": "full"}), roomy)}
    assert why["tiled_layers"].startswith("tiled_layers: auto: off, the run fits with whole layers")
    lines = {
        name: (on, why) for name, _, on, why in decisions(_cfg({"tiled_layers": 3, "activation_checkpointing": "full"}), roomy)
    }
    assert lines["tiled_layers"] == (True, "memory.tiled_layers: 3")


# ------------------------------------------------------------------------------ compile and the run


@pytest.mark.usefixtures("fresh_dynamo")
def test_regional_compile_compiles_the_inner_layer_with_equal_gradients_and_no_recompile(tokenizer):
    """The chunks run the compiled inner layer (aot_eager: real tracing, no codegen), in graphs
    around the eager chunk attention; equal and uneven chunks, grad and no grad, compile on the
    first step and the second step compiles nothing."""
    import torch._dynamo.utils as dynamo_utils

    from hone.config.performance import PerformanceConfig
    from hone.transforms.compile import compile_regional

    model = _model("tiny-qwen3", "lora", tokenizer)
    reference = _checkpointed(model)
    tiled = _tiled(model, 3)
    record = compile_regional(tiled, PerformanceConfig(torch_compile=True, torch_compile_backend="aot_eager"), dynamic=False)
    assert record["layers"] == 2
    layers = decoder_layers(tiled)
    assert all(layer.inner._compiled_call_impl is not None for layer in layers)
    assert all(getattr(layer, "_compiled_call_impl", None) is None for layer in layers)  # the wrapper stays eager
    ids = _ids(4)
    want = _run(reference, ids)
    _assert_same(_run(tiled, ids), want)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    assert graphs > 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        _assert_same(_run(tiled, ids), want)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    breaks = [
        reason for reason in dynamo_utils.counters["graph_break"] if "tiled_sdpa_attention" in reason or "disable" in reason
    ]
    assert breaks, dict(dynamo_utils.counters["graph_break"])


def test_a_training_run_through_the_planner_records_and_matches_the_untiled_run(tmp_path, write_jsonl):
    """``hone train``'s path: the attention transform picks hone's causal sdpa, checkpointing
    wraps the layers, tiled_layers replaces them, and the run trains like the untiled one."""
    gen = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(8):
        ids = torch.randint(5, 300, (31,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 4 + ids[4:]})
    data = write_jsonl(tmp_path, rows)

    plain, plain_record = tiny_lora_run(
        data, tmp_path / "plain", memory={"tiled_layers": "off"}, performance={"loss": "standard"}
    )
    steps, record = tiny_lora_run(data, tmp_path / "tiled", memory={"tiled_layers": 3}, performance={"loss": "standard"})
    names = [a["name"] for a in record["applied"]]
    assert "tiled_layers" not in [a["name"] for a in plain_record["applied"]]
    assert names.index("activation_checkpointing") < names.index("tiled_layers")
    details = next(a for a in record["applied"] if a["name"] == "tiled_layers")["details"]
    assert details["chunks"] == 3 and details["layers"] == 2 and details["classes"] == ["Qwen3DecoderLayer"]
    assert details["why"] == "memory.tiled_layers: 3" and details["attention"] == TILED_SDPA
    assert len(steps) == 2
    torch.testing.assert_close(torch.tensor(steps), torch.tensor(plain), rtol=RTOL, atol=0)
