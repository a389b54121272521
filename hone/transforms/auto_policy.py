"""``memory.activation_checkpointing: auto``: the policy picked from the memory estimate."""

from typing import Any

from hone.config.memory import choose_auto_policy
from hone.config.root import HoneConfig
from hone.transforms.estimate import POLICIES, estimate_memory, loss_of
from hone.transforms.plan_report import device_memory


def auto_checkpointing(cfg: HoneConfig, device: Any, budget: int | None = None) -> tuple[str, str]:
    """``activation_checkpointing: auto``: (policy, why) -- the fastest policy whose estimated
    peak fits the device's memory with a margin (offload only on CUDA, where its side streams
    overlap the copies; selective at ``memory.selective_memory_budget`` under Inductor)."""
    kind = getattr(device, "type", str(device))
    if budget is None:
        budget, source = device_memory(kind, None)
    else:
        source = f"a {budget / 2**30:.1f} GiB card"
    loss = loss_of(cfg)
    policies = [p for p in POLICIES if kind == "cuda" or p != "offload"]
    estimates = {p: estimate_memory(cfg, checkpointing=p, loss=loss, device=kind).total for p in policies}
    policy, why = choose_auto_policy(estimates, budget)
    return policy, f"activation_checkpointing: auto on {source}: {why}"
