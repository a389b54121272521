"""Expert parallelism: each rank holds ``E / N`` of a layer's routed experts; tokens travel.

A mixture-of-experts layer under data parallelism alone needs every expert on every rank,
though each token visits only ``k`` of them. Here the ``E`` experts are split into ``N``
contiguous blocks, one per rank of a process group (:class:`ExpertShard`), and one layer's
routed experts run in four steps, none of which waits on the host:

1. **Dispatch** (:func:`dispatch`). Each (token, slot) pair goes to the rank that owns its
   expert. Every rank fills a send buffer ``[N, C, H]``: ``C`` slots per destination rank, the
   pairs in a fixed order (grouped by destination with a stable sort, each pair's position
   within its destination from a running count on the device), unused slots are *sentinels*:
   zero rows whose local expert id is ``E / N`` (one past the last local expert). One
   all-to-all moves the rows (differentiable), a second the int64 local expert ids. Every
   shape depends only on ``T``, ``k``, ``N`` and ``C``: no ``.item()``, no ``nonzero``.
2. **Local experts** (:func:`local_experts`) on the ``N * C`` received rows. Sentinel rows are
   skipped, not computed and masked: the rows are sorted by local expert id, sentinels last,
   and hone's grouped kernels (:func:`hone.kernels.moe_lora.moe_lora_linear`) are given
   ``ends`` that cover the real experts only; the rows past ``ends[-1]`` they leave unwritten
   are zeroed. Where the kernels cannot run (a CPU) the plain-PyTorch reference computes the
   same function.
3. **Combine** (:func:`combine`): the reverse all-to-all brings each result row back to the
   slot it left from, and each token's output is the sum over its ``k`` slots of routing
   weight times row, accumulated in float32.

**Capacity** ``C`` (slots per source-destination pair of ranks; the rule is
:func:`expert_capacity`). The default is ``C = T * k``: a destination can then take every pair
of the source, so nothing can overflow whatever the routing, at the price of ``N * T * k``
rows per rank in each exchange. ``capacity_factor f`` gives ``ceil(f * T * k / N)`` rounded up
to a multiple of 8 (``f = 1`` fits perfectly balanced routing exactly). A pair that does not fit
is never dropped silently: :func:`dispatch` counts the pairs over capacity on the device and
:func:`expert_parallel_experts` returns that count beside the output; the caller checks it
once per step (one sync per step, not per layer) and refuses the step where it is non-zero.
Every rank of the group must use the same ``C`` (each all-to-all exchanges ``N * C`` rows per
rank): with the default, every rank must route the same number of tokens ``T``.

**Memory.** The send and receive buffers, and the local experts' intermediate rows (saved for
the backward), are ``N * C`` rows per rank, sentinel rows included: the kernels skip their
compute, not their storage. With the default capacity that is ``N`` times the ``T * k`` rows
one process holds without expert parallelism, so large runs want a capacity factor near 1
(with the overflow check) rather than the default.

Gradients reach the hidden states, the routing weights, the LoRA factors of the local experts
and, when they require grad (full fine-tune), the local expert weights and biases; a rank's
expert gradients hold the contributions of every rank's tokens routed to those experts, so
no gradient reduction over the expert-parallel group is needed for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hone.errors import HoneError
from hone.kernels.moe_lora import moe_lora_linear, moe_triton_available, route
from hone.kernels.moe_lora_reference import ExpertsLayout, LoraFactors, as_in_out, gated_activation
from hone.parallel.exchange import exchange

__all__ = [
    "Dispatched",
    "ExpertCapacityError",
    "ExpertShard",
    "SendPlan",
    "combine",
    "dispatch",
    "expert_capacity",
    "expert_parallel_experts",
    "LocalExperts",
    "local_experts",
    "check_overflow",
    "plan_send",
]

#: Capacities are rounded up to this many rows (tile- and vector-friendly buffer blocks).
CAPACITY_MULTIPLE = 8


@dataclass(frozen=True)
class ExpertShard:
    """Which experts this rank holds: the contiguous block ``[rank * E / N, (rank + 1) * E / N)``
    of the ``num_experts`` (``E``) global experts, ``N`` = ``size`` ranks of ``group`` (None:
    the default group)."""

    size: int
    rank: int
    num_experts: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"expert parallel size {self.size} must be at least 1")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"expert parallel rank {self.rank} is not in 0..{self.size - 1} (size {self.size})")
        if self.num_experts < 1 or self.num_experts % self.size:
            raise ValueError(
                f"{self.num_experts} experts cannot be split evenly over {self.size} expert-parallel ranks: "
                f"the number of experts must be a multiple of the expert parallel size"
            )

    @classmethod
    def of_group(cls, num_experts: int, group: dist.ProcessGroup | None = None) -> ExpertShard:
        """This process's shard over ``group`` (which must be initialised)."""
        return cls(dist.get_world_size(group), dist.get_rank(group), num_experts, group)

    @property
    def local_count(self) -> int:
        """``E / N``: the experts each rank holds; also the sentinel's local expert id."""
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        """The global id of this rank's first expert."""
        return self.rank * self.local_count

    def local(self, experts: torch.Tensor) -> torch.Tensor:
        """This rank's block of a tensor whose first dimension runs over all ``E`` experts (a view)."""
        if experts.shape[0] != self.num_experts:
            raise ValueError(f"expected a tensor over {self.num_experts} experts, got shape {tuple(experts.shape)}")
        return experts[self.first : self.first + self.local_count]


def expert_capacity(num_tokens: int, top_k: int, size: int, capacity_factor: float | None = None) -> int:
    """Slots ``C`` per source-destination pair of ranks. None: ``T * k``, the worst case (every
    pair of a rank to one destination), which cannot overflow. A factor ``f > 0``:
    ``ceil(f * T * k / N)`` rounded up to a multiple of :data:`CAPACITY_MULTIPLE`, and never more
    than the worst case needs (rounded likewise). Overflow is then possible and reported."""
    worst = num_tokens * top_k
    if capacity_factor is None:
        return worst
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor {capacity_factor!r} must be a positive number (or None: T * k, no overflow)")
    slots = min(math.ceil(capacity_factor * worst / size), worst)
    return -(-slots // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


@dataclass(frozen=True)
class SendPlan:
    """Where each (token, slot) pair sits in the send buffer; all on the device. Pair ``p`` is
    token ``p // k``'s ``p % k``-th choice; buffer slot ``d * C + i`` is the ``i``-th slot for
    destination rank ``d``."""

    source: torch.Tensor  # [N * C] int64: the token each buffer slot carries; T for a sentinel
    local_ids: torch.Tensor  # [N * C] int64: the local expert id at the destination; E / N for a sentinel
    slot: torch.Tensor  # [T * k] int64: each pair's buffer slot (0 for a pair over capacity)
    kept: torch.Tensor  # [T * k] bool: the pair fits its destination's capacity
    overflow: torch.Tensor  # [] int64: pairs over capacity (0 unless C < T * k)


def plan_send(top_k_index: torch.Tensor, shard: ExpertShard, capacity: int) -> SendPlan:
    """The send buffer's layout for ``top_k_index [T, k]`` (global expert ids): pairs grouped by
    destination rank in pair order (a stable sort), each pair's position within its destination
    from the running count of the pairs before it; pairs past ``capacity`` are left out and
    counted. No host sync: every shape follows from ``T``, ``k``, ``N`` and ``capacity``."""
    if capacity < 0:
        raise ValueError(f"capacity {capacity} must be >= 0")
    ids = top_k_index.reshape(-1).long()
    n_pairs, device = ids.shape[0], ids.device
    n_tokens = top_k_index.shape[0]
    dest = torch.div(ids, shard.local_count, rounding_mode="floor")
    order = torch.sort(dest, stable=True).indices
    counts = torch.zeros(shard.size, dtype=torch.int64, device=device).scatter_add_(0, dest, torch.ones_like(dest))
    starts = torch.cumsum(counts, 0) - counts
    arange = torch.arange(n_pairs, device=device)
    position = torch.empty_like(ids).scatter_(0, order, arange - starts[dest[order]])
    kept = position < capacity
    slot = dest * capacity + position
    n_slots = shard.size * capacity
    target = torch.where(kept, slot, n_slots)  # one trash slot past the buffer for pairs over capacity
    token_of_pair = torch.div(arange, top_k_index.shape[1], rounding_mode="floor")
    source = torch.full((n_slots + 1,), n_tokens, dtype=torch.int64, device=device).scatter_(0, target, token_of_pair)
    local_ids = torch.full((n_slots + 1,), shard.local_count, dtype=torch.int64, device=device)
    local_ids.scatter_(0, target, ids - dest * shard.local_count)
    return SendPlan(
        source=source[:n_slots],
        local_ids=local_ids[:n_slots],
        slot=torch.where(kept, slot, 0),
        kept=kept,
        overflow=(~kept).sum(),
    )


class _GatherRows(torch.autograd.Function):
    """``[hidden; 0][source]``: the send buffer, index ``T`` (a sentinel) reading a zero row.
    The backward sums each token's ``k`` rows in float32 and rounds once, as the grouped
    kernels' input gradient does; the sentinels' gradients land on the padding row, dropped."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(source)
        ctx.shape = hidden.shape
        padded = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])
        return padded[source]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (source,) = ctx.saved_tensors
        n_tokens, width = ctx.shape
        summed = torch.zeros(n_tokens + 1, width, dtype=torch.float32, device=grad.device)
        summed.index_add_(0, source, grad.float())
        return summed[:n_tokens].to(grad.dtype), None


@dataclass(frozen=True)
class Dispatched:
    """What a rank received (its experts' work) and how its own pairs were sent (for :func:`combine`)."""

    rows: torch.Tensor  # [N * C, H]: block i came from rank i; sentinel rows are zero
    local_ids: torch.Tensor  # [N * C] int64: local expert of each row; E / N for a sentinel
    plan: SendPlan


def dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, shard: ExpertShard, capacity: int) -> Dispatched:
    """Send each (token, slot) pair of ``hidden [T, H]`` / ``top_k_index [T, k]`` to the rank
    owning its expert (see the module docstring); differentiable w.r.t. ``hidden``."""
    plan = plan_send(top_k_index, shard, capacity)
    send = _GatherRows.apply(hidden, plan.source)
    rows, local_ids = exchange(send, shard.size, shard.group), exchange(plan.local_ids, shard.size, shard.group)
    return Dispatched(rows=rows, local_ids=local_ids, plan=plan)


@dataclass(frozen=True)
class LocalExperts:
    """This rank's experts as stored (``[E / N, ...]`` slices of the model's 3-D parameters, in
    ``layout``), their biases and LoRA factors (``A [E / N, r, in]``, ``B [E / N, out, r]``)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    layout: ExpertsLayout
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    gate_up_lora: LoraFactors | None = None
    down_lora: LoraFactors | None = None
    scaling: float = 1.0
    down_scaling: float | None = None

    @property
    def count(self) -> int:
        return self.gate_up.shape[0]


def local_experts(
    rows: torch.Tensor, local_ids: torch.Tensor, experts: LocalExperts, use_kernels: bool | None = None
) -> torch.Tensor:
    """The local experts on the received ``rows [S, H]`` (``local_ids [S]``, ``E / N`` marking a
    sentinel): ``[S, H]`` in ``rows``' order and dtype, zero on sentinel rows. ``use_kernels``
    None: hone's grouped kernels where they can run on ``rows``' device, else the reference."""
    if use_kernels is None:
        use_kernels = moe_triton_available(rows.device)
    down_scaling = experts.scaling if experts.down_scaling is None else experts.down_scaling
    if not use_kernels:
        return _local_experts_dense(rows, local_ids, experts, down_scaling)
    return _local_experts_grouped(rows, local_ids, experts, down_scaling)


def _project(x: torch.Tensor, weight: torch.Tensor, bias, lora: LoraFactors | None, scaling: float) -> torch.Tensor:
    """``x [S, in] @ weight [in, out] (+ bias) + s (x A^T) B^T`` for one expert, in float32."""
    y = x @ weight.float()
    if bias is not None:
        y = y + bias.float()
    if lora is not None:
        y = y + scaling * ((x @ lora[0].float().T) @ lora[1].float().T)
    return y


def _local_experts_dense(rows: torch.Tensor, local_ids: torch.Tensor, experts: LocalExperts, down_scaling: float) -> torch.Tensor:
    """The plain-PyTorch path, in float32 like :func:`~hone.kernels.moe_lora_reference.moe_experts_reference`:
    each local expert on every row, kept where the row is its own (``where``: exact, and zero on
    sentinels). Slower than gathering each expert's rows, but its autograd graph does not depend
    on the routing: a rank whose experts got no row still runs the same backward, so every rank
    reaches the backward's exchanges (a graph cut off by an empty expert would leave the other
    ranks waiting in them)."""
    layout = experts.layout
    x = rows.float()
    w_gu, w_dn = as_in_out(experts.gate_up, layout.transposed), as_in_out(experts.down, layout.transposed)
    out = torch.zeros_like(x)
    for e in range(experts.count):

        def pick(t, e=e):
            return None if t is None else t[e]

        gu_lora = None if experts.gate_up_lora is None else (experts.gate_up_lora[0][e], experts.gate_up_lora[1][e])
        dn_lora = None if experts.down_lora is None else (experts.down_lora[0][e], experts.down_lora[1][e])
        h = gated_activation(_project(x, w_gu[e], pick(experts.gate_up_bias), gu_lora, experts.scaling), layout)
        y = _project(h, w_dn[e], pick(experts.down_bias), dn_lora, down_scaling)
        out = out + torch.where((local_ids == e).unsqueeze(1), y, 0.0)
    return out.to(rows.dtype)


def _local_experts_grouped(
    rows: torch.Tensor, local_ids: torch.Tensor, experts: LocalExperts, down_scaling: float
) -> torch.Tensor:
    """The grouped-kernel path: sort by local id (a stable sort, sentinels last, their bucket
    dropped from ``ends``), run both projections on the real experts' rows only, zero the
    unwritten sentinel rows, and put the rows back in received order. In the backward the
    kernels leave the sentinel rows' input gradient unwritten too: it goes back to the sender's
    sentinel slots, which read the padding row of :func:`dispatch`, and is dropped there. The
    bias gradient puts them in a bucket past the last expert, also dropped."""
    n_rows, layout = rows.shape[0], experts.layout
    perm, ends_with_sentinels = route(local_ids.unsqueeze(1), experts.count + 1)
    ends = ends_with_sentinels[: experts.count]
    gate_up = moe_lora_linear(
        rows, perm, ends, experts.gate_up, layout.transposed, experts.gate_up_bias, experts.gate_up_lora, experts.scaling
    )
    h = gated_activation(gate_up, layout)
    y = moe_lora_linear(h, None, ends, experts.down, layout.transposed, experts.down_bias, experts.down_lora, down_scaling)
    written = torch.arange(n_rows, device=rows.device) < ends[-1]
    y = y.masked_fill(~written.unsqueeze(1), 0)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(n_rows, device=perm.device)
    return y[inverse].to(rows.dtype)


def combine(y_recv: torch.Tensor, plan: SendPlan, top_k_weights: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """``[T, H]`` float32: the results ``y_recv [N * C, H]`` (in received order) sent back to the
    ranks they came from, then each token's ``k`` rows weighted by ``top_k_weights [T, k]`` and
    summed in float32. A pair over capacity contributes nothing (``plan.overflow`` counts it)."""
    n_tokens, k = top_k_weights.shape
    back = exchange(y_recv, shard.size, shard.group)  # [N * C, H]: block d holds destination d's results for our slots
    per_choice = back[plan.slot].view(n_tokens, k, back.shape[1]).float()
    weights = torch.where(plan.kept.view(n_tokens, k), top_k_weights.float(), 0.0)
    return (per_choice * weights.unsqueeze(-1)).sum(dim=1)


def expert_parallel_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_local: torch.Tensor,
    down_local: torch.Tensor,
    layout: ExpertsLayout,
    shard: ExpertShard,
    biases: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    lora: tuple[LoraFactors | None, LoraFactors | None] | None = None,
    scaling: float = 1.0,
    down_scaling: float | None = None,
    capacity: int | None = None,
    use_kernels: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], overflow [])``: the routed experts of ``hidden [T, H]`` (``top_k_index`` in
    global expert ids, ``top_k_weights [T, k]``) computed by the ranks holding them; ``out`` in
    ``hidden``'s dtype equals :func:`~hone.kernels.moe_lora_reference.moe_experts_reference` on
    all ``E`` experts. ``gate_up_local`` / ``down_local`` (and ``biases``, the LoRA factors in
    ``lora``) are this rank's ``[E / N, ...]`` blocks (:meth:`ExpertShard.local`). ``capacity``
    None: :func:`expert_capacity`'s default, ``T * k``. ``overflow`` (int64, on the device) counts
    this rank's pairs that did not fit; the caller must refuse a step where any rank's is > 0."""
    n_tokens, k = top_k_index.shape
    if hidden.dim() != 2 or hidden.shape[0] != n_tokens or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"expected hidden [T, H] with top_k_index and top_k_weights [T, k]; got {tuple(hidden.shape)}, "
            f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
        )
    for name, weight in (("gate_up_local", gate_up_local), ("down_local", down_local)):
        if weight.shape[0] != shard.local_count:
            raise ValueError(
                f"{name} holds {weight.shape[0]} experts; rank {shard.rank} of {shard.size} holds "
                f"{shard.local_count} of {shard.num_experts}"
            )
    gate_up_bias, down_bias = biases if biases is not None else (None, None)
    gate_up_lora, down_lora = lora if lora is not None else (None, None)
    experts = LocalExperts(
        gate_up_local, down_local, layout, gate_up_bias, down_bias, gate_up_lora, down_lora, scaling, down_scaling
    )
    if capacity is None:
        capacity = expert_capacity(n_tokens, k, shard.size)
    sent = dispatch(hidden, top_k_index, shard, capacity)
    y_recv = local_experts(sent.rows, sent.local_ids, experts, use_kernels)
    return combine(y_recv, sent.plan, top_k_weights, shard).to(hidden.dtype), sent.plan.overflow


class ExpertCapacityError(HoneError):
    """Token-expert pairs did not fit the expert-parallel capacity: the step is refused, not run short."""


def check_overflow(overflow: torch.Tensor, capacity: int, shard: ExpertShard | None = None) -> None:
    """Refuse the step where pairs went over capacity: the one host sync of a step's overflow
    counts (sum them over the layers first). With ``shard`` (``N > 1``) the counts are summed
    over the group first, so every rank raises together instead of one rank leaving the others
    waiting in the next collective."""
    total = overflow.detach().to(torch.int64).reshape(())
    if shard is not None and shard.size > 1:
        total = total.clone()
        dist.all_reduce(total, group=shard.group)
    dropped = int(total)
    if dropped:
        raise ExpertCapacityError(
            f"expert parallel: {dropped} token-expert pair(s) exceeded the capacity of {capacity} slots per pair of ranks "
            "and were not computed; raise the capacity factor, or leave it unset (capacity T * k never overflows)"
        )
