"""Layer-run checkpointing's term (``memory.checkpoint_run_layers``, :mod:`hone.transforms.layer_runs`):
one saved input per run of k layers instead of one per layer, and the run's inputs rebuilt in the
backward.

Under ``full`` the runs' first inputs stay on the GPU; under ``offload`` they go to pinned host
memory, the first runs' (the split counts runs: :func:`~.offload.offload_split`), the others on the
GPU. While the backward walks a run it holds the run's k-1 rebuilt inner inputs beside what the
policy holds (its first input, or under ``offload`` that input back from the host and the previous
run's coming): :attr:`~.checkpointing.Kept.rebuilt_inputs`.
"""

from hone.transforms.memory.facts import ModelFacts
from hone.transforms.memory.step import Step
from hone.transforms.memory.terms.offload import offload_split


def run_starts(layers: int, length: int) -> list[bool]:
    """Whether each layer starts a run of ``length`` (the last run shorter where it does not divide)."""
    return [i % length == 0 for i in range(layers)]


def kept_in_runs(m: ModelFacts, step: Step, full: list[int]) -> tuple[tuple[int, ...], int, int, int | None, int]:
    """(bytes each layer keeps, the rebuilt inner inputs of one run, in flight, late in flight,
    offloaded runs) for ``full`` or ``offload`` in runs of ``step.run_layers``: a run's first layer
    keeps its input (none on the GPU where it is offloaded), the others nothing."""
    input_bytes, length = step.input_bytes, step.run_layers
    starts = run_starts(len(full), length)
    rebuilt = (min(length, len(full)) - 1) * input_bytes
    if step.policy == "full":
        return tuple(input_bytes if s else 0 for s in starts), rebuilt, 0, None, 0
    leaf = 0 if m.embedding_trainable else 1  # run 0's first input stays (a leaf under LoRA)
    runs = sum(starts)
    offloaded = offload_split(runs - leaf, input_bytes, step.offload_layers, step.host_budget)
    on_gpu = [leaf and r == 0 or r >= leaf + offloaded for r in range(runs)]
    each, r = [], -1
    for s in starts:
        r += s
        each.append(input_bytes if s and on_gpu[r] else 0)
    kept_after = runs - leaf - offloaded
    late = 0 if kept_after else None  # the copies back start once the kept runs are done and freed
    return tuple(each), rebuilt, 2 * input_bytes if offloaded else 0, late, offloaded
