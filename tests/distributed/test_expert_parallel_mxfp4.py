"""Expert parallelism over MXFP4 experts, 2 gloo ranks on the CPU (fp32): a tiny qwen3-moe with
``model.quantize: mxfp4`` and LoRA on attention + experts. Each rank quantizes its experts
through the plan and keeps its block of the blocks, scales and placeholders (``E / N`` experts),
its local experts run the float32 reference on the dequantized block; the reference is one
process holding every expert in MXFP4 (hone's experts forward, accumulation 2). The losses, the
gradient norms, the eval losses and the trained weights agree within 1e-5, and the final adapter
the two ranks write (the expert LoRA blocks gathered) is the one process's, tensor for tensor. A
run checkpointed after step 2 and resumed on 2 fresh ranks (trained weights scrambled first) ends
as the uninterrupted one: the checkpoint holds the expert LoRA of every expert, nothing of the base."""

import os
import random

import pytest
import torch
from ep_training import (
    Case,
    expert_parallel_model,
    joined_weights,
    make_config,
    resume_ranks,
    run,
    run_reference,
    shards,
    trainable,
)
from fsdp_harness import spawn
from safetensors.torch import load_file

from hone.track.metrics import read_metrics

SEED = int(os.environ.get("HONE_TEST_SEED", random.randrange(10_000)))  # fresh each session; fix it to reproduce
CASES = [
    Case("lora", False, quantize="mxfp4"),
    Case("lora", True, quantize="mxfp4"),
    Case("lora", False, "tiny-gpt-oss", quantize="mxfp4"),
]


def _mxfp4_ranks(rank: int, out, seed: int, cases: list[Case]) -> None:
    """Each case on this rank: train, write the final adapter (all ranks gather), and save the
    trained weights, which are expert blocks, and what the rank holds of the MXFP4 base."""
    from hone.models.experts import experts_modules
    from hone.models.experts.mxfp4 import is_placeholder, mxfp4_weights
    from hone.runtime.world import current_world
    from hone.train.checkpoint_io import checkpoint_io_for
    from hone.transforms.base import RunFacts

    world = current_world()
    facts = RunFacts(torch.device("cpu"), world=world)
    for case in cases:
        cfg = make_config(out / case.name, case, accumulation=1, expert_parallel=world.world_size)
        model = expert_parallel_model(case, seed, cfg, facts)
        hooks = run(model, cfg, world, facts, seed)
        checkpoint_io_for(hooks, world).save_final(model, None, out / case.name / "final", cfg.adapter)
        held = {}
        for name, module in experts_modules(model):
            base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
            for projection, (blocks, scales) in mxfp4_weights(base).items():
                placeholder = getattr(base, projection)
                held[f"{name}.{projection}"] = (
                    blocks.shape[0],
                    scales.shape[0],
                    placeholder.shape[0],
                    is_placeholder(placeholder),
                )
        sharded = {n: s.local_count for n, s in shards(model).items()}
        saved = {"weights": trainable(model), "sharded": sharded, "held": held}
        torch.save(saved, out / case.name / f"weights-rank{rank}.pt")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep-mxfp4")
    for case in CASES:
        (out / case.name).mkdir()
    try:
        spawn(_mxfp4_ranks, 2, out, SEED, CASES, timeout_s=300)
    except Exception as exc:
        raise AssertionError(f"expert-parallel MXFP4 runs (seed {SEED}) failed:\n{exc}") from exc
    return out


def _losses(path):
    rows = read_metrics(path / "metrics.jsonl")
    return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r], [r["eval_loss"] for r in rows if "eval_loss" in r]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_expert_parallel_over_mxfp4_experts_equals_one_process(two_rank_runs, tmp_path, case):
    ranks = [torch.load(two_rank_runs / case.name / f"weights-rank{r}.pt") for r in (0, 1)]
    # every rank holds 4 of the 8 experts of every layer, as MXFP4 blocks and scales, beside a placeholder
    assert ranks[0]["held"] and all(v == (4, 4, 4, True) for r in ranks for v in r["held"].values()), ranks[0]["held"]
    expected = run_reference(case, tmp_path / case.name, SEED, final=tmp_path / case.name / "final")
    ref_train, ref_eval = _losses(tmp_path / case.name)
    got_train, got_eval = _losses(two_rank_runs / case.name)
    assert len(got_train) == len(ref_train) == 3 and len(got_eval) == len(ref_eval) == 2
    assert [x for row in got_train for x in row] == pytest.approx([x for row in ref_train for x in row], rel=1e-5), SEED
    assert got_eval == pytest.approx(ref_eval, rel=1e-5), f"seed {SEED}"
    sharded = ranks[0]["sharded"]
    assert any("lora_A" in n for n in sharded) and any("lora_B" in n for n in sharded)
    assert not any(n.endswith(("gate_up_proj", "down_proj")) for n in ranks[0]["weights"])  # the base stays frozen
    joined, _ = joined_weights(two_rank_runs / case.name, 2)
    assert joined.keys() == expected.keys()
    for key, weight in expected.items():
        torch.testing.assert_close(joined[key], weight, rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key} (seed {SEED}): {m}")
    got_adapter = load_file(two_rank_runs / case.name / "final" / "adapter_model.safetensors")
    want_adapter = load_file(tmp_path / case.name / "final" / "adapter_model.safetensors")
    assert got_adapter.keys() == want_adapter.keys() and any("experts" in k for k in want_adapter)
    for key, value in want_adapter.items():
        torch.testing.assert_close(got_adapter[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


RESUMED = Case("lora", True, quantize="mxfp4")


def test_a_resumed_mxfp4_expert_parallel_run_ends_as_the_uninterrupted_one(tmp_path):
    (tmp_path / RESUMED.name).mkdir()
    spawn(resume_ranks, 2, tmp_path, SEED, [RESUMED], timeout_s=300)
    whole, resumed = tmp_path / RESUMED.name / "whole", tmp_path / RESUMED.name / "resumed"
    saved = load_file(str(whole / "checkpoints" / "step-2" / "trainable.safetensors"))
    assert any(".experts." in k and "lora_A" in k for k in saved)
    assert not any(k.endswith(("gate_up_proj", "down_proj", "_blocks", "_scales")) for k in saved)  # the frozen base stays out
    rows = {r["step"]: r["loss"] for r in read_metrics(whole / "metrics.jsonl") if "loss" in r}
    again = {r["step"]: r["loss"] for r in read_metrics(resumed / "metrics.jsonl") if "loss" in r}
    assert again[3] == pytest.approx(rows[3], rel=1e-6), f"seed {SEED}"
    for rank in (0, 1):
        want, got = torch.load(whole / f"weights-rank{rank}.pt"), torch.load(resumed / f"weights-rank{rank}.pt")
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7, msg=lambda m, key=key: f"{key}: {m}")
    final = load_file(str(whole / "final" / "adapter_model.safetensors"))
    final_again = load_file(str(resumed / "final" / "adapter_model.safetensors"))
    assert final.keys() == final_again.keys()
    for key in final:
        torch.testing.assert_close(final_again[key], final[key], rtol=1e-6, atol=1e-7, msg=key)
