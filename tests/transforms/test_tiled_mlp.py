"""Tiled MLP (issue 14): the same loss and the same gradients as the untiled model, in fp32 on
CPU, for dense and MoE models, even and uneven shards, LoRA on the MLP projections and full
fine-tune; with every checkpointing policy and under regional compile; each parameter's
gradient produced once per backward; the planner's decision and record; the config's refusals.

The reference is always the untiled model itself (a deep copy, the same weights), run through
the same forward and loss. Rows of 13 tokens, two per micro-batch: shards of the flattened
26 tokens cross the row boundary, and 3 shards are 9, 9 and 8 tokens (uneven).
"""

import copy

import pytest
import torch
from torch import nn

from hone.config import ConfigError, parse_config
from hone.testing import counting_grad_accumulations, hook_count, tiny_lora_run, tiny_model, with_random_lora
from hone.transforms.base import RunFacts
from hone.transforms.tiled_mlp import TiledMLP, TiledMLPError, apply_tiled_mlp, shard_sizes, tiled_mlp_forward

RTOL = 1e-5
BATCH, ROW = 2, 13


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread is ~100x faster than two
    threads spinning against other processes' load (seen: 3 s vs 16 ms per step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(preset: str, adapter: str, tokenizer) -> nn.Module:
    model = tiny_model(preset, tokenizer, seed=1)
    if adapter == "lora":  # LoRA on every linear: the MLP's gate, up and down projections too
        model = with_random_lora(model, seed=2)
    return model


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(5, 300, (BATCH, ROW), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(got: tuple, want: tuple) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
    assert grads.keys() == ref_grads.keys() and ref_grads
    for name, ref in ref_grads.items():
        scale = ref.abs().max().item()
        assert scale > 0, f"{name}: a zero gradient cannot tell right from wrong"
        torch.testing.assert_close(grads[name], ref, rtol=0, atol=RTOL * scale, msg=lambda m: f"{name}: {m}")


def _mlp_names(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad and ".mlp." in n}


# ------------------------------------------------------------------------------ the Function


def test_shards_are_ceil_sized_with_a_shorter_last_one():
    assert shard_sizes(26, 3) == [9, 9, 8]
    assert shard_sizes(26, 2) == [13, 13]
    assert shard_sizes(10, 4) == [3, 3, 3, 1]
    assert shard_sizes(3, 8) == [1, 1, 1]  # fewer tokens than shards
    assert sum(shard_sizes(65537, 16)) == 65537


@pytest.mark.parametrize("shards", [2, 3])
@pytest.mark.parametrize("adapter", ["lora", "full"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"])
def test_tiled_equals_untiled_loss_and_every_gradient(tokenizer, preset, adapter, shards):
    model = _model(preset, adapter, tokenizer)
    tiled = copy.deepcopy(model)
    record = apply_tiled_mlp(tiled, shards)
    assert record["shards"] == shards and record["layers"] == record["newly_tiled"] == 2
    layers = tiled.get_base_model().model.layers if adapter == "lora" else tiled.model.layers
    assert all(isinstance(layer.mlp, TiledMLP) for layer in layers)
    # the parameter names (state dict, adapter file keys) are those of the untiled model
    assert list(tiled.state_dict()) == list(model.state_dict())
    ids = _ids()
    want = _loss_and_grads(model, ids)
    if not (preset.endswith("moe") and adapter == "lora"):  # hone's LoRA leaves the experts and router alone
        assert _mlp_names(model) and _mlp_names(model) <= set(want[1])  # the MLP trains (LoRA: its adapters)
    _assert_same(_loss_and_grads(tiled, ids), want)


def test_each_parameter_gets_its_gradient_once_per_backward_and_no_hook_stays(tokenizer):
    """Gradients accumulate across backwards as untiled ones do (once per backward each: a
    per-shard ``.backward()`` would accumulate three times), and tiling leaves no hook behind."""
    model = _model("tiny-qwen3", "lora", tokenizer)
    tiled = copy.deepcopy(model)
    apply_tiled_mlp(tiled, 3)
    before = hook_count(tiled)
    ids = _ids()
    tiled.zero_grad(set_to_none=True)
    with counting_grad_accumulations(tiled) as counts:
        for _ in range(2):  # two micro-batches, accumulated
            tiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert counts and set(counts.values()) == {2}, counts
    assert hook_count(tiled) == before
    _, want = _loss_and_grads(model, ids)
    for name, ref in want.items():
        torch.testing.assert_close(
            dict(tiled.named_parameters())[name].grad, 2 * ref, rtol=0, atol=RTOL * 2 * ref.abs().max().item()
        )


class _Routed(nn.Module):
    """A token-wise block returning (output [1, n, h], router logits [n, experts]) like an MoE
    block that reports its logits, and an integer routing (not differentiable)."""

    def __init__(self, hidden: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.up = nn.Linear(hidden, 16)
        self.down = nn.Linear(16, hidden)

    def forward(self, x: torch.Tensor):
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        weight = logits.softmax(-1).max(-1, keepdim=True).values
        out = self.down(torch.nn.functional.silu(self.up(flat))) * weight
        return out.reshape(x.shape), logits, None, logits.argmax(-1)


def test_tuple_outputs_router_logits_and_non_differentiable_ones():
    torch.manual_seed(0)
    block = _Routed()
    x = torch.randn(2, 7, 8, requires_grad=True)
    gy, gl = torch.randn(2, 7, 8), torch.randn(14, 4)

    def run(fn):
        block.zero_grad(set_to_none=True)
        x.grad = None
        y, logits, none, chosen = fn()
        assert none is None and chosen.dtype == torch.long and not chosen.requires_grad
        ((y * gy).sum() + (logits * gl).sum()).backward()
        return [y.detach(), logits.detach(), chosen, x.grad.clone()] + [p.grad.clone() for p in block.parameters()]

    want = run(lambda: block(x))
    got = run(lambda: tiled_mlp_forward(block, x, 3))  # 14 tokens: 5, 5, 4
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=1e-7)


def test_a_module_that_mixes_tokens_is_refused():
    class Pool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x).mean(dim=-2)  # one row for all tokens

    with pytest.raises(TiledMLPError, match="not one row per token"):
        tiled_mlp_forward(Pool(), torch.randn(1, 6, 4, requires_grad=True), 2)


def test_lora_dropout_recomputes_the_forwards_masks():
    """With dropout in the MLP the backward's recompute must draw the forward's masks: the
    gradients are those of the output the forward returned (checked against the same shards
    computed with grad, from the same seed)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.SiLU(), nn.Linear(32, 8))
    x = torch.randn(2, 9, 8, requires_grad=True)
    g = torch.randn(2, 9, 8)

    def run(fn):
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(7)
        y = fn()
        torch.manual_seed(123)  # the backward must not depend on the RNG's state by then
        (y * g).sum().backward()
        return [y.detach(), x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]

    def shards_with_grad():
        pieces = x.reshape(-1, 8).split([6, 6, 6])
        return torch.cat([mlp(p.reshape(1, -1, 8)).reshape(-1, 8) for p in pieces]).reshape(2, 9, 8)

    want = run(shards_with_grad)
    got = run(lambda: tiled_mlp_forward(mlp, x, 3))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-7)


def test_without_grad_it_is_one_plain_call(tokenizer):
    model = _model("tiny-qwen3", "full", tokenizer)
    tiled = copy.deepcopy(model)
    apply_tiled_mlp(tiled, 3)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(tiled(input_ids=ids).logits, model(input_ids=ids).logits, rtol=RTOL, atol=1e-6)
    tiled.eval()
    assert not tiled.model.layers[0].mlp.inner.training
    tiled.train()
    assert tiled.model.layers[0].mlp.inner.training
    assert apply_tiled_mlp(tiled, 3)["newly_tiled"] == 0  # already tiled: left as it is


def test_router_logits_recorded_by_hooks_are_refused(tokenizer):
    model = tiny_model("tiny-qwen3-moe", tokenizer, output_router_logits=True)
    with pytest.raises(TiledMLPError, match="output_router_logits"):
        apply_tiled_mlp(model, 2)


# ------------------------------------------------------------------------------ composition


@pytest.mark.parametrize("policy", ["full", "selective", "offload"])
def test_checkpointed_layers_recompute_the_tiled_mlp_with_the_same_gradients(tokenizer, policy):
    """Full checkpointing recomputes the layer, and with it the tiled forward, inside the
    backward; the gradients stay those of the untiled, unchecked model."""
    from hone.transforms.checkpointing import apply_activation_checkpointing, offload_step_context

    model = _model("tiny-qwen3", "lora", tokenizer)
    tiled = copy.deepcopy(model)
    apply_tiled_mlp(tiled, 3)
    apply_activation_checkpointing(tiled, policy, offload_min_bytes=1, use_streams=False)
    ids = _ids()
    want = _loss_and_grads(model, ids)
    with offload_step_context(tiled):
        got = _loss_and_grads(tiled, ids)
    _assert_same(got, want)


def test_selective_checkpointing_keeps_nothing_the_tiled_mlp_computes_without_grad():
    """torch's selective checkpointing caches the outputs of matmuls whatever the grad mode;
    hone's policy keeps nothing computed without grad, so the shards' [tokens x intermediate]
    outputs are not held (which would undo the tiling)."""
    from torch.utils.checkpoint import _RECOMPUTE, checkpoint

    from hone.transforms.checkpointing import checkpoint_kwargs

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 8))
    x = torch.randn(2, 7, 8, requires_grad=True)
    contexts = checkpoint_kwargs("selective")["context_fn"]()
    y = checkpoint(lambda t: tiled_mlp_forward(mlp, t, 3) * 2, x, use_reentrant=False, context_fn=lambda: contexts)
    cached = [str(op) for op, entries in contexts[0].storage.items() for e in entries.values() if e is not _RECOMPUTE]
    assert cached == []
    y.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in mlp.parameters())


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("policy", ["none", "full"])
def test_regional_compile_treats_the_tiled_mlp_as_a_graph_boundary(tokenizer, policy):
    """Dynamo cannot trace a backward that calls ``torch.autograd.grad``: the tiled MLP runs
    eagerly between two compiled graphs of each layer (aot_eager: real tracing, no codegen),
    and the gradients are the untiled model's."""
    import torch._dynamo.utils as dynamo_utils

    from hone.config.performance import PerformanceConfig
    from hone.transforms.checkpointing import apply_activation_checkpointing
    from hone.transforms.compile import compile_regional

    model = _model("tiny-qwen3", "lora", tokenizer)
    tiled = copy.deepcopy(model)
    apply_tiled_mlp(tiled, 3)
    if policy != "none":
        apply_activation_checkpointing(tiled, policy, use_streams=False)
    compile_regional(tiled, PerformanceConfig(torch_compile=True, torch_compile_backend="aot_eager"), dynamic=False)
    ids = _ids()
    want = _loss_and_grads(model, ids)
    for _ in range(2):  # the second step reuses the graphs
        _assert_same(_loss_and_grads(tiled, ids), want)
    breaks = [reason for reason in dynamo_utils.counters["graph_break"] if "_tiled_boundary" in reason]
    assert breaks, dict(dynamo_utils.counters["graph_break"])


# ------------------------------------------------------------------------------ config and plan

_RAW = {"model": {"preset": "tiny-llama"}, "data": {"datasets": [{"path": "d.jsonl", "type": "pretokenized"}]}}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "true is ambiguous"),
        (1, "1 is not a shard count that tiles"),
        (0, "0 is not a shard count"),
        (-4, "-4 is not a shard count"),
        ("some", "'some' is not a tiling"),
        (2.5, "2.5 is not a tiling"),
        (None, "None is not a tiling"),
    ],
)
def test_bad_tiled_mlp_values_are_refused_with_what_is_allowed(value, message):
    with pytest.raises(ConfigError) as caught:
        parse_config({**_RAW, "memory": {"tiled_mlp": value}})
    text = str(caught.value)
    assert "memory.tiled_mlp" in text and message in text and "auto, off, or a number of shards" in text


@pytest.mark.parametrize(
    ("value", "want", "shards"), [("auto", "auto", None), ("off", "off", 0), (False, "off", 0), (4, 4, 4), ("8", 8, 8)]
)
def test_good_tiled_mlp_values(value, want, shards):
    memory = parse_config({**_RAW, "memory": {"tiled_mlp": value}}).memory
    assert memory.tiled_mlp == want and memory.tiled_mlp_shards == shards


def _plan_cfg(tiled, seq: int = 2048, policy: str = "none", intermediate: int | None = None):
    model = {"preset": "tiny-llama", "dtype": "float32"}
    if intermediate:
        model["preset_overrides"] = {"intermediate_size": intermediate}
    return parse_config(
        {
            "model": model,
            "data": {"datasets": [{"path": "d.jsonl", "type": "pretokenized"}], "sequence_len": seq},
            "adapter": {"type": "lora", "lora_target_modules": "all-linear"},
            "memory": {"tiled_mlp": tiled, "activation_checkpointing": policy},
        }
    )


def test_auto_tiles_only_when_the_mlp_is_what_does_not_fit():
    from hone.transforms.memory.estimate import estimate_memory
    from hone.transforms.memory.knobs import Knobs
    from hone.transforms.planner import decisions, plan_optimizations

    cfg = _plan_cfg("auto")
    untiled = estimate_memory(cfg, Knobs(checkpointing="none", loss="fused_linear_ce", device="cpu")).total
    tiled = estimate_memory(cfg, Knobs(checkpointing="none", loss="fused_linear_ce", device="cpu", tiled_mlp="auto")).total
    assert tiled < untiled
    cpu = torch.device("cpu")

    roomy = plan_optimizations(cfg, RunFacts(cpu, memory_bytes=untiled * 2))
    assert "tiled_mlp" not in roomy.names and roomy.skipped == []  # fits untiled: no news
    why = {name: (on, why) for name, _, on, why in decisions(cfg, RunFacts(cpu, memory_bytes=untiled * 2))}["tiled_mlp"]
    assert why[0] is False and "fits untiled" in why[1]

    between = int((tiled + untiled) / 2 / 0.9)
    tight = plan_optimizations(cfg, RunFacts(cpu, memory_bytes=between))
    assert tight.names.index("tiled_mlp") < tight.names.index("loss")
    on, why = {name: (on, why) for name, _, on, why in decisions(cfg, RunFacts(cpu, memory_bytes=between))}["tiled_mlp"]
    assert on and "what does not fit" in why and "shards" in why

    hopeless = plan_optimizations(cfg, RunFacts(cpu, memory_bytes=tiled // 2))
    assert "tiled_mlp" not in hopeless.names
    assert [s["name"] for s in hopeless.skipped] == ["tiled_mlp"] and "does not fit tiled either" in hopeless.skipped[0]["reason"]


def test_checkpointing_auto_tiles_when_no_policy_fits_untiled():
    """A wide MLP (8192) at 4K tokens: no policy fits untiled, but the fastest does tiled; the
    plan is that policy with the MLP tiled."""
    from hone.transforms.auto_policy import decide_memory
    from hone.transforms.memory.estimate import estimate_memory
    from hone.transforms.memory.knobs import Knobs

    cfg = _plan_cfg("auto", seq=4096, policy="auto", intermediate=8192)
    untiled = {
        p: estimate_memory(cfg, Knobs(checkpointing=p, loss="fused_linear_ce", device="cpu")).total
        for p in ("none", "selective", "full")
    }
    tiled = {
        p: estimate_memory(cfg, Knobs(checkpointing=p, loss="fused_linear_ce", device="cpu", tiled_mlp="auto")).total
        for p in untiled
    }
    budget = int((min(untiled.values()) + tiled["none"]) / 2 / 0.9)
    assert tiled["none"] < 0.9 * budget < min(untiled.values())
    choice = decide_memory(cfg, "cpu", budget)
    assert choice.policy == "none" and choice.shards == 64, choice  # 4096 tokens / hidden 64
    assert "with the MLP tiled in 64 shards (nothing fits untiled)" in choice.policy_why
    assert "what does not fit" in choice.tiled_why
    roomy = decide_memory(cfg, "cpu", int(max(untiled.values()) / 0.8))
    assert roomy.policy == "none" and roomy.shards == 0  # fits untiled: no tiling


def test_plan_report_shows_the_tiled_estimates():
    from hone.transforms.plan_report import plan_view, render_plan

    view = plan_view(_plan_cfg(3), "tiny", "cuda", 80 * 2**30, "--gpu-memory")
    text = render_plan(view, wide=True)
    assert "tiled MLP (3 shards): activations" in text and "tiled MLP: on, 3 shards: memory.tiled_mlp: 3" in text
    text = render_plan(view)  # 100 columns: the shorter label
    assert "tiled MLP x3: activations" in text and "tiled MLP: on, 3 shards: memory.tiled_mlp: 3" in text
    assert all(view.tiled[p].activations < view.estimates[p].activations for p in ("none", "selective"))


def test_run_records_the_tiled_mlp_in_the_plan_and_optimizations_json(tmp_path, write_jsonl):
    """``hone train``'s path: the planner applies tiled_mlp before checkpointing, the record
    says so, and the run trains like the untiled one."""
    rows = [{"input_ids": list(range(5 + i, 25 + i)), "labels": [-100] * 4 + list(range(9 + i, 25 + i))} for i in range(8)]
    data = write_jsonl(tmp_path, rows)

    plain, plain_record = tiny_lora_run(data, tmp_path / "plain", memory={"tiled_mlp": "off"})
    steps, record = tiny_lora_run(data, tmp_path / "tiled", memory={"tiled_mlp": 3})
    names = [a["name"] for a in record["applied"]]
    assert "tiled_mlp" not in [a["name"] for a in plain_record["applied"]]
    assert names.index("tiled_mlp") < names.index("activation_checkpointing")
    details = next(a for a in record["applied"] if a["name"] == "tiled_mlp")["details"]
    assert details["shards"] == 3 and details["layers"] == 2 and details["mlp_classes"] == ["Qwen3MLP"]
    assert details["why"] == "memory.tiled_mlp: 3"
    torch.testing.assert_close(torch.tensor(steps), torch.tensor(plain), rtol=RTOL, atol=0)


# ------------------------------------------------------------------------------ the estimate

ESTIMATE_TOKENS = 64
ESTIMATE_CASES = {
    "llama fp32 lora all-linear": ("tiny-llama", "float32", {"type": "lora", "lora_target_modules": "all-linear"}),
    "llama bf16 full": ("tiny-llama", "bfloat16", {"type": "none"}),
    "qwen3 bf16 lora q,k,v,o": (
        "tiny-qwen3",
        "bfloat16",
        {"type": "lora", "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    ),
    "qwen3-moe fp32 lora q,k,v,o": (
        "tiny-qwen3-moe",
        "float32",
        {"type": "lora", "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    ),
}


def _saved_bytes_of_tiled_layer(cfg, layer_index: int = 1) -> int:
    """Bytes autograd saves inside decoder layer ``layer_index`` of the tiled model for one
    forward (saved_tensors_hooks, deduplicated by storage, parameters excluded)."""
    from hone.models.loader import load_model
    from hone.models.tokenizer import load_tokenizer

    torch.manual_seed(0)
    loaded = load_model(cfg, load_tokenizer(cfg.model), "cpu")
    model = loaded.model
    apply_tiled_mlp(model, 3)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layers = next(m for n, m in model.named_modules() if n.endswith("layers") and isinstance(m, nn.ModuleList))
    current: list = [None]
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda mod, args, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda mod, args, out: current.__setitem__(0, None))
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if current[0] == layer_index and ptr not in params and ptr not in seen:
            seen.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    ids = torch.randint(1, 200, (1, ESTIMATE_TOKENS))
    autocast = loaded.autocast_dtype
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            model(input_ids=ids, use_cache=False)
    return total[0]


@pytest.mark.parametrize("case", list(ESTIMATE_CASES))
def test_tiled_layer_formula_matches_what_autograd_saves(case):
    from hone.transforms.memory.facts import model_facts
    from hone.transforms.memory.layers import layer_bytes

    preset, dtype, adapter = ESTIMATE_CASES[case]
    cfg = parse_config(
        {
            "model": {
                "preset": preset,
                "dtype": dtype,
                "attn_implementation": "sdpa",
                "preset_overrides": {"num_hidden_layers": 3},
            },
            "data": {"datasets": [{"path": "unused.jsonl", "type": "pretokenized"}], "sequence_len": ESTIMATE_TOKENS},
            "adapter": adapter,
        }
    )
    facts = model_facts(cfg)
    tiled = layer_bytes(facts.layers[1], facts, compiled=False, attention="sdpa", device="cpu", tiled=True).at(
        ESTIMATE_TOKENS, ESTIMATE_TOKENS
    )
    untiled = layer_bytes(facts.layers[1], facts, compiled=False, attention="sdpa", device="cpu").at(
        ESTIMATE_TOKENS, ESTIMATE_TOKENS
    )
    counted = _saved_bytes_of_tiled_layer(cfg)
    assert tiled == pytest.approx(counted, rel=0.10), f"{case}: formula {tiled} vs saved {counted}"
    assert tiled < untiled


def test_the_estimate_of_the_config_follows_its_tiling():
    """The bench records ``decided_estimate`` beside each measured peak: it must estimate
    the tiling the run applies (a shard count as written, ``auto`` as the planner decides)."""
    from hone.transforms.decide import decided_estimate

    assert decided_estimate(_plan_cfg(3), "cpu").tiled_mlp == 3
    assert decided_estimate(_plan_cfg("off"), "cpu").tiled_mlp == 0
    assert decided_estimate(_plan_cfg("auto"), "cpu").tiled_mlp == 0  # a tiny model fits this machine's RAM
