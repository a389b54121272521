"""The longest sequence a step fits, by bisection on the estimate."""

from typing import Literal

from hone.config.root import HoneConfig
from hone.transforms.memory.estimate import estimate_memory
from hone.transforms.memory.knobs import LossKind


def longest_sequence(
    cfg: HoneConfig,
    checkpointing: str,
    loss: LossKind,
    budget_bytes: int,
    *,
    micro_batch: int | None = None,
    compiled: bool | None = None,
    device: str = "cuda",
    multiple: int = 256,
    limit: int = 1 << 24,
    tiled_mlp: int | Literal["auto"] = 0,
    offload_layers: int | Literal["auto"] | None = None,
    host_budget: int | None = None,
    param_shards: int = 1,
    tiled_layers: int | Literal["auto"] = 0,
) -> int:
    """The longest ``sequence_len`` (a multiple of ``multiple``) whose estimated peak fits
    ``budget_bytes`` on the GPU and, when ``host_budget`` is given, whose host memory
    (``host_total``) fits that; 0 when not even ``multiple`` tokens fit. Bisection on the
    estimate, which grows with the sequence (linearly, or quadratically with eager attention;
    an ``auto`` offload split keeps fewer layers on the host as they grow, so the GPU share
    grows faster than linearly once the host is full)."""

    def fits(seq: int) -> bool:
        est = estimate_memory(
            cfg,
            checkpointing=checkpointing,
            loss=loss,
            sequence_len=seq,
            micro_batch=micro_batch,
            compiled=compiled,
            device=device,
            tiled_mlp=tiled_mlp,
            offload_layers=offload_layers,
            host_budget=host_budget,
            param_shards=param_shards,
            tiled_layers=tiled_layers,
        )
        return est.total <= budget_bytes and (host_budget is None or est.host_total <= host_budget)

    lo, hi = 0, 1
    if not fits(multiple):
        return 0
    while hi * multiple < limit and fits(hi * 2 * multiple):
        hi *= 2
    lo = hi
    hi = min(hi * 2, limit // multiple)
    while hi - lo > 1:  # fits(lo * multiple), not fits(hi * multiple)
        mid = (lo + hi) // 2
        if fits(mid * multiple):
            lo = mid
        else:
            hi = mid
    return lo * multiple
