"""The checkpointing policy's term: what each decoder layer keeps on the GPU until its backward,
and what the backward rebuilds of one layer at a time.

``none`` keeps every layer's activations; ``full`` keeps each layer's input and recomputes one
layer at a time in the backward; ``selective`` keeps the input and the matmul outputs (under
Inductor: the compiler's activation memory budget); ``offload`` moves the layers' inputs to
pinned host memory, all of them or the first ones (:mod:`hone.transforms.memory.terms.offload`),
keeping the others on the GPU; two are on the GPU while the backward walks the offloaded ones.
"""

from dataclasses import dataclass

from hone.transforms.memory.facts import ModelFacts
from hone.transforms.memory.layers import per_layer, selective_bytes
from hone.transforms.memory.step import Step
from hone.transforms.memory.terms.layer_runs import kept_in_runs
from hone.transforms.memory.terms.offload import offload_split


@dataclass(frozen=True)
class Kept:
    """What the layers hold on the GPU for their backward under one policy."""

    each: tuple[int, ...]
    """Bytes each layer keeps until its backward."""
    recompute: int
    """Bytes of one layer's activations rebuilt in the backward (0 without checkpointing)."""
    in_flight: int = 0
    """``offload``: layer inputs on the GPU while the backward walks the offloaded layers."""
    late_in_flight: int | None = None
    """Those late in the step, beside every kept layer (None: ``in_flight``)."""
    offloaded: int = 0
    """``offload``: layers (layer runs: runs) whose input is in pinned host memory."""
    rebuilt_inputs: int = 0
    """Layer runs: the inner inputs of the run the backward walks, rebuilt beside what ``each`` keeps."""

    @property
    def stored(self) -> int:
        """Every layer's kept bytes with what is in flight late in the step."""
        return sum(self.each) + (self.in_flight if self.late_in_flight is None else self.late_in_flight)


def kept_by_policy(m: ModelFacts, step: Step, full: list[int]) -> Kept:
    """The term, from ``full``: the bytes each layer keeps without checkpointing."""
    if step.policy == "none":
        return Kept(tuple(full), 0)
    if step.run_layers > 1 and step.policy in ("full", "offload"):
        each, rebuilt, in_flight, late, offloaded = kept_in_runs(m, step, full)
        return Kept(each, max(full), in_flight, late, offloaded, rebuilt)
    if step.policy == "full":
        return Kept((step.input_bytes,) * len(full), max(full))
    if step.policy == "selective":
        return _selective(m, step, full)
    return _offload(m, step, full)


def _selective(m: ModelFacts, step: Step, full: list[int]) -> Kept:
    budget = step.selective_budget
    if budget is not None:
        # the compiler's activation memory budget: each layer keeps about that fraction of what
        # it keeps unbudgeted (above its input, which it always holds), recomputing the rest
        # inside its own backward (calibrated on H100 rows: qwen3-8b at 0.2 and 0.5, llama3-8b
        # at 0.15 to 0.4). A collective's output is always kept (the partitioner never recomputes
        # one): under context parallelism, 36 x 640 MiB at 128K over 4 ranks, which the budget
        # alone missed (a qwen3-8b row estimated at 52 GiB ran out of 80 on the H100)
        forced = step.input_bytes + step.exchanged_per_token * step.tokens
        each = tuple(forced + int(budget * max(f - forced, 0)) for f in full)
        return Kept(each, int((1 - budget) * max(full)))
    each = tuple(per_layer(m, lambda layer: selective_bytes(layer, m, step.tiled).at(step.tokens, step.sequence_len)))
    return Kept(each, max(full))


def _offload(m: ModelFacts, step: Step, full: list[int]) -> Kept:
    """The first k layers' inputs go to pinned host memory, the rest stay here; while the
    backward walks the offloaded ones, two are on the GPU (one in use, one coming)."""
    input_bytes = step.input_bytes
    leaf = 0 if m.embedding_trainable else 1  # layer 0's input stays (a leaf under LoRA)
    offloaded = offload_split(len(full) - leaf, input_bytes, step.offload_layers, step.host_budget)
    kept_after = len(full) - leaf - offloaded
    each = (input_bytes,) * leaf + (0,) * offloaded + (input_bytes,) * kept_after
    # the copies back start once the kept layers are done and freed
    late = 0 if kept_after else None
    return Kept(each, max(full), 2 * input_bytes if offloaded else 0, late, offloaded)
