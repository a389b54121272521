"""Context parallelism under ``torch.compile``: 2 gloo processes compile the wrapped attention
call (the backend ``enable_context_parallel`` registers, around transformers' sdpa) with
``fullgraph=True`` and ``aot_eager`` (any graph break raises), run its forward and backward and
get the eager call's output and gradients bit for bit: Dynamo traces both all-to-alls
(:mod:`hone.parallel.exchange`) into the one graph. Grouped-query heads (4 query heads over 2
key/value heads), causal (no mask) and hone's whole-sequence document mask. Then a tiny Qwen3
whose decoder layers are compiled the same way trains one micro-batch of packed rows on its
shards and matches the eager context-parallel run."""

import pytest
import torch
from context_parallel_cases import CASES, build_model, make_batch
from fsdp_harness import save, spawn

WORLD = 2
MASKS = ["causal", "documents"]


def _attention_case(mask: str, shard):
    """This rank's q, k, v ([B, H, T/N, D], leaves), the whole-sequence mask, and a cotangent."""
    from hone.models.attention.packed_mask import document_dense_mask

    gen = torch.Generator().manual_seed(MASKS.index(mask))
    batch, length, dim = 2, 8, 8
    q, k, v, cot = (torch.randn(batch, h, length, dim, generator=gen) for h in (4, 2, 2, 4))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    attention_mask = document_dense_mask(positions) if mask == "documents" else None
    leaves = [shard.local(t, dim=2).clone().requires_grad_(True) for t in (q, k, v)]
    return leaves, attention_mask, shard.local(cot.transpose(1, 2), dim=1)  # cotangent of [B, T/N, H, D]


def _attention_runs(mask: str) -> dict:
    from torch._dynamo.testing import CompileCounterWithBackend
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hone.models.attention.ulysses import CONTEXT_SHARD_ATTR, register_ulysses
    from hone.parallel.context_parallel import ContextShard

    torch._dynamo.reset()
    shard = ContextShard.of_group()
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    setattr(module, CONTEXT_SHARD_ATTR, shard)
    wrapped = ALL_ATTENTION_FUNCTIONS[register_ulysses("sdpa")]
    counter = CompileCounterWithBackend("aot_eager")
    got = {}
    for mode in ("eager", "compiled"):
        (q, k, v), attention_mask, cotangent = _attention_case(mask, shard)

        def attend(q, k, v, attention_mask=attention_mask):
            return wrapped(module, q, k, v, attention_mask, dropout=0.0, scaling=0.3)[0]

        run = attend if mode == "eager" else torch.compile(attend, backend=counter, fullgraph=True)
        out = run(q, k, v)
        (out * cotangent).sum().backward()
        got[mode] = {"out": out.detach(), "grads": [t.grad for t in (q, k, v)]}
    got["frames"] = counter.frame_count
    return got


def _model_runs() -> dict:
    """A tiny Qwen3 (LoRA, packed rows, hone's document mask through its causal sdpa) on this rank's shard, eager and
    with every decoder layer compiled (fullgraph, aot_eager)."""
    from hone.models.attention.layout import layout_for
    from hone.models.attention.ulysses import enable_context_parallel
    from hone.models.structure import decoder_layers
    from hone.parallel.context_parallel import ContextShard, shard_micro_batch
    from hone.runtime.loss import standard_loss
    from hone.runtime.step import micro_batch_loss

    torch._dynamo.reset()
    case = CASES["tiny-qwen3-lora-packed-causal-cp2"]
    got = {}
    for mode in ("eager", "compiled"):
        model = build_model(case)
        shard = ContextShard.of_group()
        enable_context_parallel(model, shard)
        if mode == "compiled":
            for layer in decoder_layers(model):
                layer.compile(backend="aot_eager", fullgraph=True)
        batch = shard_micro_batch(make_batch(case).with_attention(layout_for(model)), shard)
        loss = micro_batch_loss(model, batch, standard_loss())
        loss.backward()
        got[mode] = {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}}
    return got


def _worker(rank: int, out) -> None:
    results = {mask: _attention_runs(mask) for mask in MASKS}
    results["model"] = _model_runs()
    save(results, out / f"{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("context_parallel_compile")
    spawn(_worker, WORLD, out, timeout_s=600)
    return [torch.load(out / f"{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("mask", MASKS)
def test_the_compiled_wrapped_attention_is_the_eager_one(ranks, mask):
    for rank, results in enumerate(ranks):
        eager, compiled = results[mask]["eager"], results[mask]["compiled"]
        assert eager["out"].shape == (2, 4, 4, 8)  # [B, T/N, H, D]: this rank's positions, every head
        assert torch.equal(compiled["out"], eager["out"]), rank
        for want, have in zip(eager["grads"], compiled["grads"], strict=True):
            assert want.abs().sum() > 0 and torch.equal(have, want), rank
        assert results[mask]["frames"] == 1  # one graph holds both exchanges


def test_compiled_decoder_layers_train_as_the_eager_ones(ranks):
    for rank, results in enumerate(ranks):
        eager, compiled = results["model"]["eager"], results["model"]["compiled"]
        torch.testing.assert_close(compiled["loss"], eager["loss"], rtol=1e-6, atol=0)
        assert set(compiled["grads"]) == set(eager["grads"]) and eager["grads"]
        for name, want in eager["grads"].items():
            torch.testing.assert_close(compiled["grads"][name], want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{rank} {name}: {m}")
