"""Expert parallelism under ``torch.compile``: 2 gloo processes compile a function that runs
:func:`~hone.parallel.expert_parallel.expert_parallel_experts` with ``fullgraph=True`` (any graph
break raises), run its forward and backward, and compare with the same call run eagerly on the
same rank: ``aot_eager`` bit for bit (the exchanges move the same bytes), Inductor within 1e-5
(it may reorder float32 sums). The floating-point exchanges are torch's functional
``all_to_all_single_autograd`` while compiling (:mod:`hone.parallel.exchange`), traced into one
graph: a compiled decoder layer keeps them inside its graph. A capacity too small returns the
same overflow count compiled; so does Inductor with ``reorder_for_compute_comm_overlap`` and its
passes on exchanges in 2 chunks (they move collectives and waits; the result must not change),
which issues both chunks' exchanges before the first wait.
Inductor and gloo work together on the CPU. With torch 2.11 the
autograd Function traced before that fix gave every gradient exactly zero; this file fails there
without the fix (checked in a torch 2.11 environment; CI runs 2.13, which traced it right)."""

import pytest
import torch
from ep_training import Case
from expert_parallel_cases import (
    DOWN_SCALING,
    EXPERTS,
    SCALING,
    SMALL_CAPACITY,
    TOKENS,
    WORLD,
    grads_of,
    leaves,
    lora_of,
    make_case,
)
from fsdp_harness import save, spawn

#: (case, backend, capacity): Inductor on the LoRA case, aot_eager on the others (faster to compile).
#: ``inductor-overlap``: Inductor with ``reorder_for_compute_comm_overlap`` on exchanges in 2 chunks
#: (``performance.torch_compile_options``), which may move the collectives and their waits.
RUNS = [
    ("qwen3_moe-lora", "inductor", None),
    ("qwen3_moe-lora", "inductor-overlap", None),
    ("gpt_oss-full", "aot_eager", None),
    ("qwen3_moe-skewed", "aot_eager", SMALL_CAPACITY),
]


#: What ``performance.torch_compile_options: {reorder_for_compute_comm_overlap: true}`` hands Inductor.
OVERLAP_OPTIONS = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": [
        "reorder_communication_preserving_peak_memory",
        "sink_waits_iterative",
        "reorder_communication_preserving_peak_memory",
    ],
}


def _one_run(rank: int, name: str, backend: str, capacity: int | None) -> dict:
    """Eager and compiled results of one case on this rank (fresh leaves for each)."""
    import torch._inductor.config
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.utils import run_and_get_code

    from hone.parallel.expert_parallel import ExpertShard, expert_parallel_experts

    torch._dynamo.reset()
    shard = ExpertShard.of_group(EXPERTS)
    case = make_case(name)
    tokens = slice(rank * TOKENS, (rank + 1) * TOKENS)
    index = case["index"][tokens]
    overlap = backend == "inductor-overlap"
    counter = CompileCounterWithBackend("inductor" if overlap else backend)
    got = {}
    for mode in ("eager", "compiled"):
        t = leaves(case, lambda key, v: v[tokens] if key in ("hidden", "weights") else shard.local(v))

        def experts(hidden, weights, t=t):
            return expert_parallel_experts(
                hidden, index, weights, t["gate_up_proj"], t["down_proj"], case["layout"], shard,
                biases=(t["gate_up_bias"], t["down_bias"]), lora=lora_of(t), scaling=SCALING, down_scaling=DOWN_SCALING,
                capacity=capacity, chunks=2 if overlap else 1,
            )  # fmt: skip

        run = experts if mode == "eager" else torch.compile(experts, backend=counter, fullgraph=True)

        def step(run=run, t=t):
            out, overflow = run(t["hidden"], t["weights"])
            (out * case["cotangent"][tokens]).sum().backward()
            return out, overflow

        # the backward compiles at its first call: the options must hold through it
        with torch._inductor.config.patch(OVERLAP_OPTIONS if overlap and mode == "compiled" else {}):
            if overlap and mode == "compiled":
                (out, overflow), code = run_and_get_code(step)
                got["issued_before_first_wait"] = _issued_before_first_wait(code[0])
            else:
                out, overflow = step()
        got[mode] = {"out": out.detach(), "overflow": int(overflow), "grads": grads_of(t)}
    got["frames"] = counter.frame_count
    return got


def _issued_before_first_wait(code: str) -> int:
    """All-to-alls the compiled forward issues before it first waits for one."""
    lines = code.splitlines()
    first_wait = next(i for i, line in enumerate(lines) if "wait_tensor.default(" in line)
    return sum("all_to_all_single.default(" in line for line in lines[:first_wait])


def _worker(rank: int, out) -> None:
    save({f"{name}/{backend}": _one_run(rank, name, backend, capacity) for name, backend, capacity in RUNS}, out / f"{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("expert_parallel_compile")
    spawn(_worker, WORLD, out, timeout_s=600)
    return [torch.load(out / f"{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("name,backend,capacity", RUNS)
def test_compiled_expert_parallel_matches_eager(ranks, name, backend, capacity):
    for rank, results in enumerate(ranks):
        got = results[f"{name}/{backend}"]
        eager, compiled = got["eager"], got["compiled"]
        assert compiled["overflow"] == eager["overflow"], rank
        assert set(compiled["grads"]) == set(eager["grads"]) and eager["grads"], rank
        pairs = [("out", eager["out"], compiled["out"])] + [(k, v, compiled["grads"][k]) for k, v in eager["grads"].items()]
        for what, want, have in pairs:
            if backend == "aot_eager":
                assert torch.equal(have, want), (rank, what)
            else:
                torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} {what}: {m}")


@pytest.mark.parametrize("name,backend,capacity", RUNS)
def test_one_graph_holds_the_exchanges(ranks, name, backend, capacity):
    for results in ranks:
        assert results[f"{name}/{backend}"]["frames"] == 1  # fullgraph: one frame, no break (a break would have raised)


def test_the_overlap_option_issues_every_chunks_exchanges_before_the_first_wait(ranks):
    """With the passes hone hands Inductor (hone.transforms.inductor.COMM_OVERLAP_PASSES), the
    compiled forward issues both chunks' three dispatch exchanges before it waits for the first,
    so chunk 2's travel while chunk 1 computes; without them every wait follows its all-to-all
    at once (torch 2.11: 1 issued before the first wait, the switch on or off)."""
    from hone.transforms.inductor import COMM_OVERLAP_PASSES

    assert OVERLAP_OPTIONS["reorder_for_compute_comm_overlap_passes"] == list(COMM_OVERLAP_PASSES)
    for results in ranks:
        assert results["qwen3_moe-lora/inductor-overlap"]["issued_before_first_wait"] == 6


def test_the_small_capacity_overflows_compiled_too(ranks):
    # every pair of the skewed routing lands on rank 1's experts: only rank 1 is over capacity
    overflow = [results["qwen3_moe-skewed/aot_eager"]["compiled"]["overflow"] for results in ranks]
    assert overflow[0] == 0 and overflow[1] > 0


def _layer_worker(rank: int, out) -> None:
    """A 2-rank training run through the plan's regional compile (aot_eager on the CPU), with a
    capacity factor: hone's experts forward, its overflow buffer's ``add_`` included, and the
    exchanges inside each compiled decoder layer. Dynamo's counters say whether anything broke."""
    from ep_training import run_ranks
    from torch._dynamo.utils import counters

    counters.clear()
    run_ranks(rank, out, 3, [LAYER_CASE])
    save({"breaks": dict(counters["graph_break"]), "frames": dict(counters["frames"])}, out / f"layer-{rank}.pt")


#: Padded rows (packed ones overflow a factor of 1), LoRA on attention and experts, compiled.
LAYER_CASE = Case("lora", False, composed=True, capacity_factor=1.0)


@pytest.mark.slow
def test_compiled_decoder_layers_do_not_break_at_the_exchanges(tmp_path):
    (tmp_path / LAYER_CASE.name).mkdir()
    spawn(_layer_worker, WORLD, tmp_path, timeout_s=600)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"layer-{rank}.pt")
        assert got["breaks"] == {}, (rank, got["breaks"])
        assert got["frames"]["total"] >= 1 and got["frames"]["ok"] == got["frames"]["total"], (rank, got["frames"])
