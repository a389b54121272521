"""scripts/memory_at_peak.py's replay of the allocator's history (the GPU run itself is a tool)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from memory_at_peak import live_at_peak  # noqa: E402


def _event(action, addr, size, line):
    return {"action": action, "addr": addr, "size": size, "frames": [{"filename": "/x/hone/a.py", "line": line, "name": "f"}]}


def test_the_peak_is_the_largest_sum_of_live_step_allocations_and_lists_those_alive_then():
    events = [
        _event("alloc", 1, 100, 1),
        _event("alloc", 2, 50, 2),
        _event("free_requested", 1, 100, 1),
        _event("free_completed", 1, 100, 1),  # not a second free
        _event("alloc", 3, 120, 3),  # 50 + 120 = 170: the peak
        _event("free_requested", 9, 500, 4),  # a block from before the step: lowers what follows
        _event("alloc", 4, 400, 5),  # 170 - 500 + 400 = 70
    ]
    peak, groups = live_at_peak(events)
    assert peak == 170
    assert sorted((size, count) for size, count in groups.values()) == [(50, 1), (120, 1)]
