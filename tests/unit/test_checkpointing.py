"""Activation checkpointing policies: the config key and its alias, ``auto``'s choice, and for
every policy the gradients of ``none`` (fp32, CPU; LoRA with random B and full fine-tune; eager
and regionally compiled); what selective keeps and recomputes; what offload moves to the host."""

import gc
import random
import weakref

import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from hone.config import ConfigError, parse_config
from hone.config.loader import dump_config
from hone.config.memory import choose_auto_policy
from hone.config.performance import PerformanceConfig
from hone.models.attention.varlen import VARLEN_SDPA, register_varlen_sdpa
from hone.models.structure import decoder_layers
from hone.testing import offload_step, packed_document_logits, random_documents, tiny_model, with_random_lora
from hone.transforms.checkpointing import (
    SAVED_OPS,
    CheckpointingError,
    apply_activation_checkpointing,
    offload_step_context,
    offloader_for,
    selective_policy,
)
from hone.transforms.compile import compile_regional
from hone.transforms.offload import OffloadActivations

POLICIES = ["full", "selective", "offload"]
GiB = 2**30


# ---------------------------------------------------------------- config


def _cfg(memory):
    return parse_config(
        {"model": {"preset": "tiny-llama"}, "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca"}]}, "memory": memory}
    )


@pytest.mark.parametrize(
    ("memory", "policy"),
    [
        ({}, "auto"),
        ({"gradient_checkpointing": True}, "full"),
        ({"gradient_checkpointing": False}, "none"),
        ({"activation_checkpointing": "selective"}, "selective"),
        ({"activation_checkpointing": "auto"}, "auto"),
        ({"activation_checkpointing": "full", "gradient_checkpointing": True}, "full"),
        ({"activation_checkpointing": "none", "gradient_checkpointing": False}, "none"),
    ],
)
def test_policy_and_alias(memory, policy):
    cfg = _cfg(memory)
    assert cfg.memory.checkpointing == policy
    assert cfg.memory.activation_checkpointing == memory.get("activation_checkpointing", "auto")  # not rewritten
    if "gradient_checkpointing" in memory:
        assert cfg.memory.alias_note == f"memory.gradient_checkpointing is an alias of memory.activation_checkpointing: {policy}"
    else:
        assert cfg.memory.alias_note is None


@pytest.mark.parametrize("memory", [{"gradient_checkpointing": True}, {"activation_checkpointing": "offload"}])
def test_resolved_config_writes_the_policy_and_loads_back(memory):
    cfg = _cfg(memory)
    dumped = yaml.safe_load(dump_config(cfg))
    expected = {
        "activation_checkpointing": cfg.memory.checkpointing,
        "selective_memory_budget": "auto",
        "tiled_mlp": "auto",
        "tiled_layers": "auto",
        "offload_layers": "auto",
    }
    assert {k: dumped["memory"][k] for k in expected} == expected
    assert "gradient_checkpointing" not in dumped["memory"]  # the alias is written resolved
    assert parse_config(dumped).memory.checkpointing == cfg.memory.checkpointing


@pytest.mark.parametrize(("gc_value", "policy"), [(True, "selective"), (True, "none"), (False, "full"), (False, "offload")])
def test_disagreeing_alias_names_both_keys(gc_value, policy):
    with pytest.raises(ConfigError) as info:
        _cfg({"gradient_checkpointing": gc_value, "activation_checkpointing": policy})
    text = str(info.value)
    assert "memory.gradient_checkpointing" in text and "memory.activation_checkpointing" in text
    assert policy in text and ("true" if gc_value else "false") in text


def test_unknown_policy_lists_the_allowed_values():
    with pytest.raises(ConfigError) as info:
        _cfg({"activation_checkpointing": "fulll"})
    text = str(info.value)
    assert "memory.activation_checkpointing" in text and "'fulll'" in text
    for value in ("none", "full", "selective", "offload", "auto"):
        assert value in text
    assert "did you mean 'full'" in text


def test_choose_auto_policy_takes_the_fastest_that_fits():
    est = {"none": 70 * GiB, "selective": 50 * GiB, "full": 30 * GiB, "offload": 20 * GiB}
    assert choose_auto_policy(est, 80 * GiB)[0] == "none"  # 70 <= 72
    policy, reason = choose_auto_policy(est, 75 * GiB)  # 67.5 usable: none no longer fits
    assert policy == "selective" and "none needs 70.0 GiB" in reason and "50.0 GiB" in reason
    assert choose_auto_policy(est, 75 * GiB, margin=0.0)[0] == "none"
    assert choose_auto_policy(est, 40 * GiB)[0] == "full"
    assert choose_auto_policy({"none": 70 * GiB, "offload": 20 * GiB}, 40 * GiB)[0] == "offload"


def test_choose_auto_policy_when_nothing_fits_says_so():
    policy, reason = choose_auto_policy({"none": 90 * GiB, "full": 85 * GiB, "offload": 79 * GiB}, 80 * GiB)
    assert policy == "offload" and reason.startswith("offload: no policy fits")
    with pytest.raises(ValueError, match="estimates must name"):
        choose_auto_policy({"fast": 1}, 10)


# ---------------------------------------------------------------- parity with `none`


def _model(preset, tokenizer, adapter):
    model = tiny_model(preset, tokenizer, seed=11)
    model.config._attn_implementation = "sdpa"
    if adapter == "lora":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(12)  # PEFT draws A from the global generator: the same A for every policy
            model = with_random_lora(model, seed=13)
    return model.train()


def _ids(seed, batch=2, length=24):
    return torch.randint(7, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


def _assert_same_grads(got, want, tol=1e-5):
    assert got.keys() == want.keys() and want
    for name, ref in want.items():
        assert ref.abs().max() > 0, f"{name}: a zero gradient cannot tell policies apart"
        err = (got[name] - ref).abs().max() / ref.abs().max()
        assert err <= tol, f"{name}: relative difference {err:.2e}"


@pytest.mark.parametrize("adapter", ["lora", "full"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe"])
def test_every_policy_gives_the_gradients_of_none(preset, adapter, tokenizer):
    ids = _ids(seed=21)
    loss_ref, ref = offload_step(_model(preset, tokenizer, adapter), ids)
    for policy in POLICIES:
        model = _model(preset, tokenizer, adapter)
        record = apply_activation_checkpointing(model, policy, offload_min_bytes=1)
        assert record["policy"] == policy and record["layers"] == len(decoder_layers(model)) == 2
        loss, grads = offload_step(model, ids)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
        _assert_same_grads(grads, ref)
        if adapter == "lora":
            assert any("lora_A" in n for n in grads) and not any("embed_tokens" in n for n in grads)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("adapter", ["lora", "full"])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_composes_with_regional_compile(policy, adapter, tokenizer):
    """Checkpointing first, then compile (the planner's order): the checkpoint and a selective
    policy are traced into each compiled layer; offload still sees exactly the layer inputs."""
    ids = _ids(seed=22)
    _, ref = offload_step(_model("tiny-llama", tokenizer, adapter), ids)
    model = _model("tiny-llama", tokenizer, adapter)
    apply_activation_checkpointing(model, policy, offload_min_bytes=1)
    torch._dynamo.reset()
    compile_regional(model, PerformanceConfig(torch_compile=True, torch_compile_backend="aot_eager"), dynamic=False)
    for _ in range(2):  # the second step runs the cached graphs
        _, grads = offload_step(model, ids)
        _assert_same_grads(grads, ref)
    if policy == "offload":  # with LoRA, layer 0's input is a leaf that autograd holds anyway
        stats = offloader_for(model).stats
        packed = 1 if adapter == "lora" else 2
        assert stats.packed == packed and stats.shapes == [(2, 24, 64)] * packed


@pytest.mark.parametrize("impl", ["sdpa", VARLEN_SDPA])
def test_every_policy_composes_with_packing(impl, tokenizer):
    """Packed rows (a block-diagonal mask, or document boundaries for hone's varlen sdpa) reach
    each layer as keyword arguments, which the checkpoint keeps for the recompute."""
    docs = random_documents([9, 5, 13, 7, 6], seed=28)
    bins = [[0, 1, 3], [2, 4]]

    def run(policy):
        model = _model("tiny-llama", tokenizer, "lora")
        if impl == VARLEN_SDPA:
            register_varlen_sdpa()
        model.set_attn_implementation(impl)
        if policy != "none":
            apply_activation_checkpointing(model, policy, offload_min_bytes=1)
        with offload_step_context(model):
            pieces = packed_document_logits(model, docs, bins, width=24)
            # a random linear "loss" per document, so every logit's gradient is random too
            loss = sum((x * torch.randn(x.shape, generator=torch.Generator().manual_seed(i))).sum() for i, x in pieces.items())
            loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ref = run("none")
    for policy in POLICIES:
        _assert_same_grads(run(policy), ref)


def test_a_model_without_checkpointing_support_is_refused():
    with pytest.raises(CheckpointingError, match="memory.activation_checkpointing: full: Linear does not support"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "full")
    with pytest.raises(ValueError, match="decide auto first"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "auto")


# ---------------------------------------------------------------- selective: what it keeps


class _CountOps(TorchDispatchMode):
    """Counts the aten ops that actually run (ops served from selective checkpointing's cache
    never reach a mode pushed before the recompute)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def matmuls(self):
        return sum(n for op, n in self.counts.items() if op.split(".")[-1] in ("mm", "addmm", "bmm", "baddbmm"))

    def total(self):
        return sum(self.counts.values())


def _backward_ops(policy, tokenizer):
    model = _model("tiny-llama", tokenizer, "lora")
    if policy != "none":
        apply_activation_checkpointing(model, policy)
    else:  # as checkpointing does, so layer 0's input gradient is computed in every case
        model.get_base_model().enable_input_require_grads()
    loss = model(input_ids=_ids(seed=23), labels=_ids(seed=23), use_cache=False).loss
    with _CountOps() as ops:
        loss.backward()
    return ops


def test_selective_recomputes_no_matmul_but_full_recomputes_them_all(tokenizer):
    none, full, selective = (_backward_ops(p, tokenizer) for p in ("none", "full", "selective"))
    assert full.matmuls() > none.matmuls()  # full recomputes every projection of every layer
    assert selective.matmuls() == none.matmuls()  # selective kept every matmul output
    assert none.total() < selective.total() < full.total()  # it recomputes the cheap ops only
    assert "aten.mul" in selective.counts and selective.counts["aten.mul"] > none.counts["aten.mul"]


def test_selective_policy_saves_matmuls_and_attention_kernels():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    for op in (
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    ):
        assert selective_policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    for op in (aten.mul.Tensor, aten.rsqrt.default, aten.silu.default, aten.add.Tensor, aten._to_copy.default):
        assert selective_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op
    assert torch.ops.higher_order.flex_attention in SAVED_OPS


# ---------------------------------------------------------------- offload: what goes to the host


def _layer_inputs(model):
    """The hidden states each decoder layer receives, in order, via forward pre-hooks."""
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0])) for layer in decoder_layers(model)]
    return seen, hooks


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_offload_packs_exactly_the_layer_inputs(adapter, tokenizer):
    model = _model("tiny-qwen3-moe", tokenizer, adapter)
    record = apply_activation_checkpointing(model, "offload", offload_min_bytes=1)
    assert record["offload"]["paused_at"] == "model.norm"
    offloader = offloader_for(model)
    seen, hooks = _layer_inputs(model)
    ids = _ids(seed=24, batch=3, length=17)
    with offload_step_context(model):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for h in hooks:
        h.remove()
    # With LoRA, layer 0's input is the (frozen) embedding's output made to require grad: a leaf,
    # which autograd's gradient accumulator holds on the device anyway, so it is not copied.
    moved = seen[1:] if adapter == "lora" else seen
    assert [t.grad_fn is None for t in seen] == [adapter == "lora", False]
    stats = offloader.stats
    assert stats.packed == len(moved) and stats.shapes == [tuple(t.shape) for t in moved] == [(3, 17, 64)] * len(moved)
    assert stats.packed_bytes == sum(t.numel() * t.element_size() for t in moved)
    assert stats.kept > 0  # the rest of what autograd saved (weights, the loss's) stayed put
    assert stats.prefetched == len(moved) - 1  # layer 1's unpack started layer 0's copy back


def test_offload_holds_host_copies_and_frees_the_layer_inputs(tokenizer):
    """Between the forward and the backward the device (here: the original tensors) keeps no
    layer input: under full checkpointing the checkpoint holds them; under offload only host
    copies are held (distinct storage, equal values), and the originals are freed."""

    def held_after_forward(policy):
        model = _model("tiny-llama", tokenizer, "full")
        apply_activation_checkpointing(model, policy, offload_min_bytes=1)
        seen, hooks = _layer_inputs(model)
        ids = _ids(seed=25)
        with offload_step_context(model):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            for h in hooks:
                h.remove()
            values = [t.detach().clone() for t in seen]
            refs = [weakref.ref(t) for t in seen]
            seen.clear()
            gc.collect()
            alive = [r() is not None for r in refs]
            offloader = offloader_for(model)
            if offloader is not None:
                hosts = [s.host for s in offloader._saved]
                assert [h.device.type for h in hosts] == ["cpu", "cpu"]
                for host, value in zip(hosts, values):
                    torch.testing.assert_close(host, value, rtol=0, atol=0)
            loss.backward()
        if offloader is not None:
            assert offloader._saved == []  # released when the micro-batch ends
        return alive

    assert held_after_forward("full") == [True, True]
    assert held_after_forward("offload") == [False, False]


def test_offload_skips_small_tensors_weights_leaves_and_tensors_without_grad():
    weight = torch.nn.Parameter(torch.randn(64, 64))
    frozen = torch.nn.Linear(64, 64).requires_grad_(False)

    def run(offloader):
        gen = torch.Generator().manual_seed(27)
        leaf = torch.randn(16, 64, generator=gen).requires_grad_()
        z = torch.randn(16, 64, generator=gen)  # no grad
        big = leaf * 1.5  # an activation of 4 KiB
        small = leaf[:1, :4] * 1.0  # an activation of 16 bytes
        weight.grad = None
        with offloader.step_context() if offloader else torch.enable_grad():
            y = (big @ weight).sum()  # saves big (packed) and weight (a parameter: kept)
            y = y + frozen(big).sum()  # saves the frozen weight only (kept)
            y = y + (small * small).sum()  # small: kept
            y = y + (leaf * z).sum()  # saves z, which needs no grad: kept
            y = y + (leaf * big).sum()  # saves the leaf (kept) and big (packed)
            y.backward()
        return leaf.grad, weight.grad

    off = OffloadActivations(min_bytes=1024, model=frozen)
    got = run(off)
    assert off.stats.packed == 2 and off.stats.shapes == [(16, 64)] * 2
    assert off.stats.kept >= 5
    for g, want in zip(got, run(None)):
        torch.testing.assert_close(g, want, rtol=0, atol=0)


def test_offload_is_paused_after_the_last_layer(tokenizer):
    """The final norm pauses it: the head's input and the loss stay where they are."""
    model = _model("tiny-llama", tokenizer, "full")
    apply_activation_checkpointing(model, "offload", offload_min_bytes=1)
    offloader = offloader_for(model)
    offloader.pause = lambda: None  # without the pause, the norm's and the head's inputs are packed too
    ids = _ids(seed=26)
    with offload_step_context(model):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert offloader.stats.packed > 2


def test_step_context_is_a_no_op_without_offload(tokenizer):
    model = _model("tiny-llama", tokenizer, "lora")
    apply_activation_checkpointing(model, "full")
    assert offloader_for(model) is None
    with offload_step_context(model):
        assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_the_offloader_registry_does_not_keep_a_model_alive(tokenizer):
    model = _model("tiny-llama", tokenizer, "full")
    apply_activation_checkpointing(model, "offload")
    assert offloader_for(model) is not None
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_the_memory_budget_context_reaches_inductor_compiled_code():
    """``selective`` under Inductor: the budget set around a micro-batch changes what a layer
    compiled inside it saves for the backward (fewer bytes at a lower budget), and gradients
    stay those of the unbudgeted graph."""
    import torch._dynamo

    from hone.transforms.checkpointing import memory_budget_context

    def layer(x, w1, w2, w3):
        h = torch.nn.functional.silu(x @ w1) * (x @ w2)
        return (h @ w3).relu().sum()

    gen = torch.Generator().manual_seed(random.randrange(1000))
    inputs = [
        torch.randn(128, 32, generator=gen),
        torch.randn(32, 128, generator=gen),
        torch.randn(32, 128, generator=gen),
        torch.randn(128, 32, generator=gen),
    ]

    def run(budget):
        torch._dynamo.reset()
        compiled = torch.compile(layer, backend="inductor")
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        saved = []
        with (
            memory_budget_context(budget),
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t),
        ):
            compiled(*leaves).backward()
        return sum(saved), [t.grad for t in leaves]

    full_bytes, full_grads = run(1.0)
    low_bytes, low_grads = run(0.1)
    assert low_bytes < full_bytes
    for got, want in zip(low_grads, full_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
