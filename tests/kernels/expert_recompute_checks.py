"""What a compiled local expert step saves for its backward, with and without
``distributed.expert_parallel_recompute`` (:func:`hone.parallel.expert_parallel._recomputed`),
through the grouped kernels and the min-cut partitioner Inductor uses (``aot_eager_decomp_partition``
runs it without generating code). Run on the CPU under Triton's interpreter by
tests/kernels/test_expert_parallel_kernels.py: ``python expert_recompute_checks.py`` prints
``RESULT {json}`` with the first dimensions of the saved tensors and the step's row and pair counts.

On 4 H200 a recomputed qwen3-30b-a3b step kept one hidden-wide row per pair row more than the
estimate without it (benchmarks/2026-11-28-h200x4-expert-parallel.md); this check says the
compiled local step itself keeps none, so that row is held elsewhere."""

import json
import sys

import torch
from expert_local_checks import LAYOUTS, local_case

from hone.parallel import expert_parallel as ep
from hone.parallel.expert_parallel import LocalExperts

TRAINED = ("rows", "weights", "gu_A", "gu_B", "dn_A", "dn_B")


def saved_first_dims(recompute: bool, rows: int = 48, k: int = 2) -> list[int]:
    """The first dimension of every tensor the compiled local step saves (LoRA on the experts)."""
    layout = LAYOUTS["qwen3_moe"]
    case = local_case(layout, 0.3, rows=rows, hidden=32, inter=24, local=4, k=k, rank=4)
    t = {n: v.clone().requires_grad_(n in TRAINED) for n, v in case.items() if v is not None and n not in ("cotangent", "ids")}
    experts = LocalExperts(t["gate_up"], t["down"], layout, None, None, (t["gu_A"], t["gu_B"]), (t["dn_A"], t["dn_B"]), 0.5, 0.25)
    run = ep._recomputed if recompute else ep.local_experts

    def step(received: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return run(received * 1.0, case["ids"], weights, experts, None, True).rows

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager_decomp_partition", fullgraph=True)
    dims: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        dims.append(x.shape[0] if x.dim() else 0)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = compiled(t["rows"], t["weights"])
    (out * case["cotangent"]).sum().backward()
    assert t["gu_A"].grad is not None and t["rows"].grad is not None
    return dims


if __name__ == "__main__":
    rows, k = 48, 2
    out = {"rows": rows, "pairs": rows * k}
    out.update({name: saved_first_dims(flag, rows, k) for name, flag in (("kept", False), ("recomputed", True))})
    print("RESULT " + json.dumps(out), file=sys.stdout)
