"""The longest sequence a step fits, by bisection on the estimate."""

from dataclasses import replace

from hone.config.root import HoneConfig
from hone.transforms.memory.decide import fits_within
from hone.transforms.memory.estimate import estimate_memory
from hone.transforms.memory.knobs import Knobs


def longest_sequence(cfg: HoneConfig, knobs: Knobs, budget_bytes: int, *, multiple: int = 256, limit: int = 1 << 24) -> int:
    """The longest ``sequence_len`` (a multiple of ``multiple``) of the step ``knobs`` describes
    (their ``sequence_len`` aside) whose estimated peak fits ``budget_bytes`` on the GPU (less the
    margin every "fits" keeps: :func:`~hone.transforms.memory.decide.fits_within`) and,
    when ``knobs.host_budget`` is given, whose host memory (``host_total``) fits that; 0 when not
    even ``multiple`` tokens fit. Bisection on the estimate, which grows with the sequence
    (linearly, or quadratically with eager attention; an ``auto`` offload split keeps fewer
    layers on the host as they grow, so the GPU share grows faster than linearly once the host is
    full)."""

    def fits(seq: int) -> bool:
        return fits_within(estimate_memory(cfg, replace(knobs, sequence_len=seq)), budget_bytes, knobs.host_budget)

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
