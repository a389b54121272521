"""Expert parallelism's local step over MXFP4 experts: the grouped MXFP4 kernels against the
float32 reference (the rank's block dequantized, then the plain-PyTorch path), on one rank's
received rows with a share of choices held elsewhere (local id ``E / N``) and, at share 1, only
sentinel slots. Output and the gradients of the rows, the routing weights, the LoRA factors
and the biases (gpt-oss' layout has them); the base is frozen. tests/kernels/
test_expert_parallel_kernels.py runs ``python expert_local_mxfp4_checks.py`` under Triton's
interpreter (small sizes; prints ``RESULT {json}``); a GPU test can call
:func:`mxfp4_relative_errors` at real sizes."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from expert_local_checks import LAYOUTS, compare_local, local_case  # noqa: E402
from moe_mxfp4_checks import random_mxfp4  # noqa: E402

from hone.parallel.expert_parallel import LocalExperts, local_experts  # noqa: E402

TRAINED = ("rows", "weights", "gate_up_bias", "down_bias", "gu_A", "gu_B", "dn_A", "dn_B")


def mxfp4_case(layout, sentinel_share: float, seed: int = 0, **sizes) -> dict:
    """:func:`~expert_local_checks.local_case` with both expert weights random MXFP4 ``[E / N, out, in]``."""
    case = local_case(layout, sentinel_share, seed=seed, **sizes)
    gen = torch.Generator().manual_seed(seed + 1)
    local, hidden = case["gu_A"].shape[0], case["gu_A"].shape[2]
    inter = case["dn_A"].shape[2]
    case["gate_up"] = random_mxfp4(local, 2 * inter, hidden, gen)
    case["down"] = random_mxfp4(local, hidden, inter, gen)
    return case


def run_mxfp4_local(case: dict, layout, use_kernels: bool, device: str, capacity=None) -> dict:
    """Output, overflow and gradients of :func:`local_experts` on an MXFP4 ``case``."""
    skip = ("cotangent", "ids", "gate_up", "down")
    t = {n: None if v is None else v.to(device).clone().requires_grad_(n in TRAINED) for n, v in case.items() if n not in skip}
    mx = {name: tuple(part.to(device) for part in case[name]) for name in ("gate_up", "down")}
    experts = LocalExperts(
        mx["gate_up"], mx["down"], layout, t["gate_up_bias"], t["down_bias"],
        (t["gu_A"], t["gu_B"]), (t["dn_A"], t["dn_B"]), 0.5, 0.25,
    )  # fmt: skip
    got = local_experts(t["rows"], case["ids"].to(device), t["weights"], experts, capacity, use_kernels)
    (got.rows.float() * case["cotangent"].to(device)).sum().backward()
    result = {"out": got.rows.detach().float(), "overflow": got.overflow.item()}
    result.update({n: v.grad.float() for n, v in t.items() if v is not None and v.grad is not None})
    return result


def mxfp4_relative_errors(layout_name: str, sentinel_share: float, device: str, capacity=None, **sizes) -> dict:
    """Each compared tensor's relative error (``"nonfinite"`` / ``"nonzero"`` where it should be
    finite / zero), the sentinel rows' largest output magnitude and the overflow difference."""
    layout = LAYOUTS[layout_name]
    case = mxfp4_case(layout, sentinel_share, **sizes)
    want = run_mxfp4_local(case, layout, use_kernels=False, device=device, capacity=capacity)
    got = run_mxfp4_local(case, layout, use_kernels=True, device=device, capacity=capacity)
    return compare_local(want, got, case["ids"].lt(case["gu_A"].shape[0]).any(dim=1).to(device))


if __name__ == "__main__":
    small = dict(rows=24, hidden=64, inter=32, local=4, k=3, rank=4)
    out = {}
    for layout_name in LAYOUTS:
        for share in (0.0, 0.6, 1.0):
            out[f"{layout_name}-{share}"] = mxfp4_relative_errors(layout_name, share, "cpu", **small)
    print("RESULT " + json.dumps(out), file=sys.stdout)
