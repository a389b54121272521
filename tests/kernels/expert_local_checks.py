"""Expert parallelism's local step through hone's grouped kernels against the plain-PyTorch
path: one rank's received token rows, each with ``k`` choices of which a share are held by
other ranks (local id ``E / N``) and some rows only such choices (sentinel slots, zero rows);
output, and the gradients of the rows, the routing weights, the LoRA factors (``lora``) or
the expert weights and biases (``full``). Used by the GPU test (real sizes) and, on the CPU,
by tests/kernels/test_expert_parallel_kernels.py under Triton's interpreter (small sizes):
``python expert_local_checks.py`` prints ``RESULT {json}`` with the relative errors."""

import json
import sys

import torch

from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE
from hone.parallel.expert_parallel import LocalExperts, local_experts

LAYOUTS = {"qwen3_moe": QWEN3_MOE, "gpt_oss": GPT_OSS}


def local_case(layout, sentinel_share: float, rows=512, hidden=256, inter=128, local=8, k=4, rank=16, seed=0) -> dict:
    """Received rows whose choices are local experts (expert 3 never chosen) or, with
    probability ``sentinel_share``, held elsewhere; rows with no local choice arrive as zeros."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape, std=1.0: torch.randn(*shape, generator=gen) * std  # noqa: E731
    ids = torch.randint(0, local, (rows, k), generator=gen)
    ids[ids == 3] = 4
    ids[torch.rand(rows, k, generator=gen) < sentinel_share] = local
    here = ids < local
    if layout.transposed:
        gate_up, down = rand(local, hidden, 2 * inter, std=0.1), rand(local, inter, hidden, std=0.1)
    else:
        gate_up, down = rand(local, 2 * inter, hidden, std=0.1), rand(local, hidden, inter, std=0.1)
    bias = layout is GPT_OSS
    return dict(
        ids=ids,
        rows=rand(rows, hidden) * here.any(dim=1, keepdim=True),
        weights=torch.rand(rows, k, generator=gen) * here,
        cotangent=rand(rows, hidden),
        gate_up=gate_up,
        down=down,
        gate_up_bias=rand(local, 2 * inter) if bias else None,
        down_bias=rand(local, hidden) if bias else None,
        gu_A=rand(local, rank, hidden, std=0.1),
        gu_B=rand(local, 2 * inter, rank, std=0.1),
        dn_A=rand(local, rank, inter, std=0.1),
        dn_B=rand(local, hidden, rank, std=0.1),
    )


def run_local(case: dict, layout, trained: str, use_kernels: bool, device: str, capacity=None) -> dict:
    """Output, overflow and gradients of :func:`local_experts` on ``case``."""
    train = {"rows", "weights"} | (
        {"gu_A", "gu_B", "dn_A", "dn_B"} if trained == "lora" else {"gate_up", "down", "gate_up_bias", "down_bias"}
    )
    inputs = {n: v for n, v in case.items() if n not in ("cotangent", "ids")}
    t = {n: None if v is None else v.to(device).clone().requires_grad_(n in train) for n, v in inputs.items()}
    lora = trained == "lora"
    experts = LocalExperts(
        t["gate_up"], t["down"], layout, t["gate_up_bias"], t["down_bias"],
        (t["gu_A"], t["gu_B"]) if lora else None, (t["dn_A"], t["dn_B"]) if lora else None, 0.5, 0.25,
    )  # fmt: skip
    got = local_experts(t["rows"], case["ids"].to(device), t["weights"], experts, capacity, use_kernels)
    (got.rows * case["cotangent"].to(device)).sum().backward()
    result = {"out": got.rows.detach(), "overflow": got.overflow.item()}
    result.update({n: v.grad for n, v in t.items() if v is not None and v.grad is not None})
    return result


def relative_errors(layout_name: str, trained: str, sentinel_share: float, device: str, **sizes) -> dict:
    """Each compared tensor's relative error (``"nonfinite"`` / ``"nonzero"`` where it should be
    finite / zero), plus the sentinel rows' largest output magnitude."""
    layout = LAYOUTS[layout_name]
    case = local_case(layout, sentinel_share, **sizes)
    want = run_local(case, layout, trained, use_kernels=False, device=device)
    got = run_local(case, layout, trained, use_kernels=True, device=device)
    return compare_local(want, got, case["ids"].lt(case["gu_A"].shape[0]).any(dim=1).to(device))


def compare_local(want: dict, got: dict, real: torch.Tensor) -> dict:
    """The kernels' results ``got`` against the plain path's ``want``: each tensor's relative
    error (``"nonfinite"`` / ``"nonzero"`` where it should be finite / zero), the sentinel rows'
    largest output magnitude and the overflow difference; ``real`` marks the received rows with
    a local choice (a sentinel slot's gradient is dropped by its sender, so it is not compared)."""
    want["rows"], got["rows"] = want["rows"][real], got["rows"][real]
    errors: dict = {"sentinel_out": got["out"][~real].abs().max().item() if (~real).any() else 0.0}
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name, expected in want.items():
        if name == "overflow":
            errors[name] = got[name] - expected
        elif not torch.isfinite(got[name]).all():
            errors[name] = "nonfinite"
        elif expected.abs().sum() == 0:
            errors[name] = 0.0 if got[name].abs().sum() == 0 else "nonzero"
        else:
            errors[name] = ((got[name] - expected).norm() / expected.norm()).item()
    return errors


if __name__ == "__main__":
    small = dict(rows=24, hidden=32, inter=16, local=4, k=3, rank=4)
    out = {}
    for layout_name in LAYOUTS:
        for trained in ("lora", "full"):
            for share in (0.0, 0.6, 1.0):
                out[f"{layout_name}-{trained}-{share}"] = relative_errors(layout_name, trained, share, "cpu", **small)
    print("RESULT " + json.dumps(out), file=sys.stdout)
