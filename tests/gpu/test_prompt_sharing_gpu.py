"""Shared-prompt DPO on CUDA through the plan: ``share_prompt: auto`` takes torch's varlen kernel
with the tree boundaries in bf16, flex attention with the tree block mask in compiled fp32 layers
(its backward exists on the GPU only), and trains as the unshared pairs do (the varlen kernel in
bf16, sdpa's mask in fp32); the varlen kernel on the tree against its reference at a real
model's shapes. Skipped without a GPU."""

import random

import pytest
import torch
from rich.console import Console

from hone.data.pairs import collate_pairs
from hone.models.attention.setup import FLEX_MIN_HEAD_DIM
from hone.models.attention.varlen import VARLEN_SDPA, grouped_heads_native, reference_varlen_attention, varlen_attention
from hone.testing import tiny_config, tiny_llama, with_random_lora
from hone.track.metrics import read_metrics
from hone.train.loop import train_loop
from hone.transforms.base import RunFacts
from hone.transforms.planner import plan_optimizations

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")


def _pairs(n: int, seed: int) -> list[dict[str, list[int]]]:
    """Pairs long enough for flex attention's full kernels (rows of 300-500 tokens)."""
    gen = random.Random(seed)

    def ids(low: int, high: int) -> list[int]:
        return [gen.randrange(1, 97) for _ in range(gen.randint(low, high))]

    return [{"prompt_ids": ids(100, 200), "chosen_ids": ids(60, 140), "rejected_ids": ids(60, 140)} for _ in range(n)]


def _run(tmp_path, share: bool, dtype: str, pairs, seed: int):
    cfg = tiny_config(
        tmp_path / f"{dtype}-{share}",
        model={"preset": "tiny-llama", "dtype": dtype},
        data={"datasets": [{"path": "unused.jsonl", "type": "preference"}], "sequence_len": 384},
        adapter={"type": "lora", "lora_r": 4},
        # bf16 compares the first step only (the test's docstring): one step compiles less
        training={
            "micro_batch_size": 2,
            "max_steps": 1 if dtype == "bfloat16" else 3,
            "objective": "dpo",
            "preference": {"beta": 0.5, "share_prompt": share},
        },
        optimizer={"learning_rate": 1e-2, "adam_epsilon": 1e-3},
        performance={"torch_compile": True},
    )
    facts = RunFacts(CUDA, shape_note="pairs", lengths_vary=True)
    plan = plan_optimizations(cfg, facts)
    torch.manual_seed(seed)
    base = tiny_llama(seed, head_dim=FLEX_MIN_HEAD_DIM).to(CUDA)
    base.config._attn_implementation = "sdpa"
    plan.apply(base, "base", cfg, facts)
    model = with_random_lora(base, seed + 2).to(CUDA)
    plan.apply(model, "adapted", cfg, facts)
    hooks = plan.hooks(model, cfg, facts)
    assert hooks.layout.shares_prompt is share
    if share:
        kind, backend = ("tree_boundaries", VARLEN_SDPA) if dtype == "bfloat16" else ("block_mask", "flex_attention")
        assert hooks.layout.kind == kind and model.config._attn_implementation == backend
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    train_loop(model, pairs, None, cfg, device=CUDA, pad_id=0, console=Console(quiet=True), hooks=hooks, autocast_dtype=autocast)
    rows = [r for r in read_metrics(cfg.training.output_dir / "metrics.jsonl") if "loss" in r]
    return rows, {n: p.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype,rel", [("float32", 1e-3), ("bfloat16", 3e-2)])
def test_shared_prompts_train_through_the_plan_s_kernel_as_the_unshared_pairs(tmp_path, dtype, rel):
    """fp32: every step's loss and log-probs and the final weights. bf16: the first step's
    log-probs only (the same weights in both runs): a DPO loss is a difference of sums of a few
    hundred log-probs, each run rounds them in its own order, and after one Adam step at this
    learning rate the two runs' weights part by more than bf16's tolerance (seen on an H200: step
    losses 0.303 against 0.355 with fp32 passing at 1e-3)."""
    seed = random.randrange(10_000)
    pairs = _pairs(6, seed)
    torch._dynamo.reset()
    plain, plain_weights = _run(tmp_path, False, dtype, pairs, seed)
    torch._dynamo.reset()
    shared, weights = _run(tmp_path, True, dtype, pairs, seed)
    steps = list(zip(plain, shared, strict=True))
    names = ("loss", "logps/chosen", "logps/rejected")
    if dtype == "bfloat16":
        names = names[1:]
    for a, b in steps:
        for name in names:
            assert b[name] == pytest.approx(a[name], rel=rel, abs=rel), (name, seed)
    if dtype == "float32":
        for name, weight in plain_weights.items():
            torch.testing.assert_close(weights[name], weight, rtol=rel, atol=rel * 0.1)


def test_the_varlen_kernel_on_the_tree_equals_its_reference_at_qwen3_8b_shapes():
    """Two pairs of a 512-token prompt and 768-token completions, 32 query and 8 key/value heads
    of 128, bf16: output and the three input gradients against the fp32 reference. The grouped
    key/value heads go to the kernel as training hands them (probed first, as the plan does)."""
    grouped_heads_native(CUDA)
    gen = random.Random(0)
    pairs = [
        {
            k: [gen.randrange(1, 97) for _ in range(n)]
            for k, n in (("prompt_ids", 512), ("chosen_ids", 768), ("rejected_ids", 768))
        }
    ] * 2
    batch = collate_pairs(pairs, pad_id=0, share_prompt=True).to(CUDA)
    tree, width = batch.tree, batch.input_ids.shape[1]
    torch.manual_seed(0)
    q, k, v = (torch.randn(width, heads, 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True) for heads in (32, 8, 8))
    grad = torch.randn(width, 32, 128, device=CUDA, dtype=torch.bfloat16)
    out = varlen_attention(q, k[tree.key_index], v[tree.key_index], tree.queries, width, 128**-0.5, tree.keys, width)
    fused = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference_varlen_attention(q32, k32[tree.key_index], v32[tree.key_index], tree.queries, 128**-0.5, tree.keys)
    expected = [ref, *torch.autograd.grad(ref, (q32, k32, v32), grad.float())]
    for name, a, b in zip(("out", "dq", "dk", "dv"), fused, expected, strict=True):
        assert (a.float() - b).abs().max() <= 2e-2 * b.abs().max(), name
