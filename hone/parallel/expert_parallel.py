"""Expert parallelism: each rank holds ``E / N`` of a layer's routed experts; tokens travel.

A mixture-of-experts layer under data parallelism alone needs every expert on every rank,
though each token visits only ``k`` of them. Here the ``E`` experts are split into ``N``
contiguous blocks, one per rank of a process group (:class:`ExpertShard`), and one layer's
routed experts run in three steps, none of which waits on the host:

1. **Dispatch** (:func:`dispatch`). Each token travels **once to each rank that holds any of its
   ``k`` experts** (not once per expert: with ``k = 8`` over 2 ranks that is 2 rows instead of 8),
   with its ``k`` routing weights and the local ids of its experts there (``E / N``, one past the
   last local expert, marks a choice the rank does not hold). Every rank fills a send buffer of
   ``N x S`` token slots, ``S`` = the largest number of tokens any rank routes: a token goes to a
   rank at most once, so ``S`` slots per pair of ranks always fit and **no token is ever
   dropped**. A token's slot within its destination comes from a running count on the device;
   unused slots are *sentinels* (zero rows, every choice marked). One all-to-all moves the rows,
   one the weights (both differentiable), one the int64 local ids. Every shape depends only on
   ``S``, ``k`` and ``N``: no ``.item()``, no ``nonzero``.
2. **Local experts** (:func:`local_experts`) on the ``N x S`` received token rows: their
   (token, choice) pairs are sorted by local expert, non-local choices last, and hone's grouped
   kernels (:func:`hone.kernels.moe_lora.moe_lora_linear`) run the first ``R`` of them with
   ``ends`` covering the real experts only: the sentinel pairs are skipped, not computed and
   masked; the gated activation between them reads and writes the real pairs' rows only
   (:func:`~hone.kernels.gated_rows.gated_rows`, the count on the device). Each received
   token's local pairs are then weighted and summed in float32 into one
   row (a *partial* output), rounded to the hidden dtype for the way back. Where the kernels
   cannot run (a CPU) the plain-PyTorch reference computes the same function.
3. **Combine** (:func:`combine`): the reverse all-to-all brings each partial row back to the
   slot it left from, and each token's output is the sum of its partials (at most ``N``), in
   float32, in rank order (deterministic).

**Capacity** ``R`` (the pair rows a rank's grouped kernels hold per layer; the rule is
:func:`expert_capacity`). The default is the worst case, ``N x S x min(k, E / N)``: nothing can
overflow whatever the routing. ``capacity_factor f`` gives ``ceil(f x S x k)`` rounded up to a
multiple of 8 (``f = 1`` fits perfectly balanced routing exactly: each rank computes ``S x k``
pairs on average). A pair that does not fit is never dropped silently: :func:`local_experts`
counts the pairs over capacity on the device and :func:`expert_parallel_experts` returns that
count beside the output; the caller checks it once per step (one sync per step, not per layer)
and refuses the step where it is non-zero.

**Traffic and memory.** Each exchange moves ``N x S`` rows of ``hidden`` per rank (the tokens
out, the partials back), sentinel slots included; that is ``N`` rows per token where one row per
(token, expert) pair would be ``k`` (with ``k = 8``: 4x less at ``N = 2``, 2x at ``N = 4``). The
grouped kernels' rows (gate/up output, activation, expert output, kept for the backward) are
``R`` per layer: with the default, ``N`` times one process's ``S x k``, so large runs want a
capacity factor near 1.25 (with the overflow check).

Gradients reach the hidden states, the routing weights, the LoRA factors of the local experts
and, when they require grad (full fine-tune), the local expert weights and biases; a rank's
expert gradients hold the contributions of every rank's tokens of the group routed to those
experts, so no gradient reduction over the expert-parallel group is needed for them (only over
the replicas of the block, where the group is a part of the job: :mod:`hone.parallel.groups`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from hone.errors import HoneError
from hone.kernels.gated_rows import gated_rows
from hone.kernels.moe_lora import gather_rows_sum, moe_lora_linear, moe_triton_available, route, with_zero_row
from hone.kernels.moe_lora_reference import ExpertsLayout, LoraFactors, as_in_out, expert_projection, gated_activation
from hone.kernels.moe_mxfp4 import MxExperts, moe_mxfp4_linear
from hone.kernels.moe_mxfp4_reference import dequantized
from hone.kernels.scaled_rows import scaled_rows
from hone.parallel.exchange import exchange

__all__ = [
    "Dispatched",
    "ExpertCapacityError",
    "ExpertShard",
    "LocalExperts",
    "Partials",
    "SendPlan",
    "check_overflow",
    "combine",
    "dequantized_experts",
    "dispatch",
    "expert_capacity",
    "expert_parallel_experts",
    "local_experts",
    "plan_send",
    "token_chunks",
]

#: Capacities are rounded up to this many rows (tile- and vector-friendly buffer blocks).
CAPACITY_MULTIPLE = 8


@dataclass(frozen=True)
class ExpertShard:
    """Which experts this rank holds: the contiguous block ``[rank * E / N, (rank + 1) * E / N)``
    of the ``num_experts`` (``E``) global experts, ``N`` = ``size`` ranks of ``group`` (None:
    the default group). ``replicas``: the ranks of the job holding the same block, where ``N`` is
    less than the job's ranks (:mod:`hone.parallel.groups`; None: no replicas)."""

    size: int
    rank: int
    num_experts: int
    group: dist.ProcessGroup | None = None
    replicas: dist.ProcessGroup | None = None

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


def expert_capacity(
    num_tokens: int, top_k: int, size: int, capacity_factor: float | None = None, local_count: int | None = None
) -> int:
    """Pair rows ``R`` a rank's grouped kernels hold per layer, for ``num_tokens`` (``S``) token
    slots per pair of ranks. None: the worst case ``N x S x min(k, E / N)`` (``local_count`` =
    ``E / N``; unknown: ``k``), which cannot overflow. A factor ``f > 0``: ``ceil(f x S x k)``
    rounded up to a multiple of :data:`CAPACITY_MULTIPLE`, never more than the worst case needs
    (rounded likewise). Overflow is then possible and reported."""
    worst = size * num_tokens * min(top_k, local_count or top_k)
    if capacity_factor is None:
        return worst
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor {capacity_factor!r} must be a positive number (or None: no overflow)")
    return _whole_blocks(min(math.ceil(capacity_factor * num_tokens * top_k), worst))


def _whole_blocks(rows: int) -> int:
    """``rows`` rounded up to a multiple of :data:`CAPACITY_MULTIPLE`."""
    return -(-rows // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


@dataclass(frozen=True)
class SendPlan:
    """Where each token sits in the send buffer; all on the device. Buffer slot ``d * S + i`` is
    the ``i``-th token slot for destination rank ``d``; index ``N * S`` is a trash slot past the
    buffer (reads a zero row)."""

    source: torch.Tensor  # [N * S] int64: the token each slot carries; T (a zero row) for a sentinel
    local_ids: torch.Tensor  # [N * S, k] int64: each choice's local expert at the destination; E / N where not there
    slot: torch.Tensor  # [T, N] int64: the token's slot for each destination; N * S where it has no expert there


def plan_send(top_k_index: torch.Tensor, shard: ExpertShard, slots: int) -> SendPlan:
    """The send buffer's layout for ``top_k_index [T, k]`` (global expert ids), ``slots`` (``S``
    >= ``T``) per destination: each token once per rank holding any of its experts, in token
    order (its position from the running count of the tokens before it). No host sync: every
    shape follows from ``T``, ``k``, ``N`` and ``S``.

    It runs as one opaque op (``hone::expert_parallel_plan_send``): torch 2.11's Inductor fails
    to generate code when it fuses the slot arithmetic (an ``arange`` beside the running count)
    into its scan kernel (``TypeError: list indices must be integers or slices, not NoneType``
    in ``get_block_shape``, on the H100 at 4096 tokens over 2 ranks). The plan is integer
    bookkeeping with no gradient, a few small eager kernels per layer (not profiled on their own
    since the running count was made contiguous), and no compiler version can miscompile it."""
    n_tokens, _ = top_k_index.shape
    if slots < n_tokens:
        raise ValueError(f"{slots} token slots per rank cannot hold the {n_tokens} tokens routed here")
    source, local_ids, slot = _plan_send_op(top_k_index, shard.size, shard.local_count, slots)
    return SendPlan(source=source, local_ids=local_ids, slot=slot)


@torch.library.custom_op("hone::expert_parallel_plan_send", mutates_args=())
def _plan_send_op(
    top_k_index: torch.Tensor, size: int, count: int, slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`plan_send` for ``size`` ranks of ``count`` experts each: ``(source, local_ids, slot)``."""
    n_tokens, k = top_k_index.shape
    ids, device = top_k_index.long(), top_k_index.device
    dest = torch.div(ids, count, rounding_mode="floor")  # [T, k]
    # [N, T]: the running count runs along the contiguous dimension (torch's scan down the
    # outer dimension of [T, N] took 0.65 ms a layer at T = 4096, N = 4 on the H100)
    present = torch.zeros(size, n_tokens, dtype=torch.bool, device=device).scatter_(0, dest.t(), True)
    position = torch.cumsum(present, 1) - 1
    n_slots = size * slots
    base = torch.arange(size, device=device).unsqueeze(1) * slots
    slot = torch.where(present, base + position, n_slots).t().contiguous()  # [T, N]
    # writes into a trash slot past the buffer (several tokens may land there; it is cut off)
    tokens = torch.arange(n_tokens, device=device).repeat_interleave(size)
    source = torch.full((n_slots + 1,), n_tokens, dtype=torch.int64, device=device).index_put_((slot.reshape(-1),), tokens)
    ranks = torch.arange(size, device=device).view(1, size, 1)
    here = dest.unsqueeze(1) == ranks  # [T, N, k]: choice j of token t is on rank d
    local = torch.where(here, (ids - dest * count).unsqueeze(1), count)  # [T, N, k]
    local_ids = torch.full((n_slots + 1, k), count, dtype=torch.int64, device=device)
    local_ids.index_put_((slot.reshape(-1),), local.reshape(-1, k))
    return source[:n_slots].clone(), local_ids[:n_slots].clone(), slot


@_plan_send_op.register_fake
def _(top_k_index: torch.Tensor, size: int, count: int, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_tokens, k = top_k_index.shape
    new = lambda *shape: top_k_index.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return new(size * slots), new(size * slots, k), new(n_tokens, size)


class _GatherRows(torch.autograd.Function):
    """``[hidden; 0][source]``: the send buffer, index ``T`` (a sentinel) reading a zero row.
    The backward gathers each token's rows (one per destination, ``slot [T, N]``; ``N x S``, a
    zero row, where it has no expert there) and sums them in float32, in rank order: a gather,
    so no float32 buffer of the tokens to zero, no atomics, and the same sum on every run."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, source: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slot)
        return with_zero_row(hidden)[source]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (slot,) = ctx.saved_tensors
        return gather_rows_sum(grad, slot).to(grad.dtype), None, None


@dataclass(frozen=True)
class Dispatched:
    """What a rank received (its experts' work) and how its own tokens were sent (for :func:`combine`)."""

    rows: torch.Tensor  # [N * S, H]: block i came from rank i; sentinel rows are zero
    local_ids: torch.Tensor  # [N * S, k] int64: each row's choices as local experts; E / N where not here
    weights: torch.Tensor  # [N * S, k] float32: the routing weights, zero where the choice is not here
    plan: SendPlan


def dispatch(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, shard: ExpertShard, slots: int
) -> Dispatched:
    """Send each token of ``hidden [T, H]`` (``top_k_index`` / ``top_k_weights [T, k]``) once to
    every rank owning one of its experts (see the module docstring); differentiable w.r.t.
    ``hidden`` and ``top_k_weights``."""
    plan = plan_send(top_k_index, shard, slots)
    send = _GatherRows.apply(hidden, plan.source, plan.slot)
    weights = with_zero_row(top_k_weights.float())
    send_weights = torch.where(plan.local_ids < shard.local_count, weights[plan.source], 0.0)
    group, size = shard.group, shard.size
    return Dispatched(
        rows=exchange(send, size, group),
        local_ids=exchange(plan.local_ids, size, group),
        weights=exchange(send_weights, size, group),
        plan=plan,
    )


@dataclass(frozen=True)
class LocalExperts:
    """This rank's experts as stored (``[E / N, ...]`` slices of the model's 3-D parameters, in
    ``layout``), their biases and LoRA factors (``A [E / N, r, in]``, ``B [E / N, out, r]``).
    A projection may instead be MXFP4 (``(blocks [E / N, out, in / 32, 16], scales [E / N, out,
    in / 32])``, always ``[E / N, out, in]`` whatever ``layout.transposed`` says; both or neither)."""

    gate_up: torch.Tensor | MxExperts
    down: torch.Tensor | MxExperts
    layout: ExpertsLayout
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    gate_up_lora: LoraFactors | None = None
    down_lora: LoraFactors | None = None
    scaling: float = 1.0
    down_scaling: float | None = None

    @property
    def count(self) -> int:
        return _expert_count(self.gate_up)

    @property
    def mxfp4(self) -> bool:
        """Whether both projections are MXFP4 blocks and scales (the grouped MXFP4 kernels run them)."""
        return isinstance(self.gate_up, tuple)


def _expert_count(weight: torch.Tensor | MxExperts) -> int:
    return (weight[0] if isinstance(weight, tuple) else weight).shape[0]


def dequantized_experts(experts: LocalExperts) -> LocalExperts:
    """``experts`` with MXFP4 projections dequantized to float32 ``[E / N, out, in]`` (exact): what
    the plain-PyTorch path computes with (frozen: the base holds no gradient)."""
    if not experts.mxfp4:
        return experts
    layout = dataclasses.replace(experts.layout, transposed=False)
    return dataclasses.replace(experts, gate_up=dequantized(experts.gate_up), down=dequantized(experts.down), layout=layout)


@dataclass(frozen=True)
class Partials:
    """The local experts' result for the received rows: ``rows [N * S, H]`` (each received
    token's local pairs weighted and summed in float32, in the rows' dtype; zero on sentinels)
    and ``overflow`` (int64 on the device: local pairs past the capacity, not computed)."""

    rows: torch.Tensor
    overflow: torch.Tensor


def local_experts(
    rows: torch.Tensor,
    local_ids: torch.Tensor,
    weights: torch.Tensor,
    experts: LocalExperts,
    capacity: int | None = None,
    use_kernels: bool | None = None,
) -> Partials:
    """The local experts on the received ``rows [S', H]`` with their choices ``local_ids [S', k]``
    (``E / N`` marking a choice held elsewhere) and routing ``weights [S', k]``. ``capacity``: the
    most pairs the grouped kernels hold (None: every pair, ``S' x k``). ``use_kernels`` None:
    hone's grouped kernels where they can run on ``rows``' device, else the reference. MXFP4
    experts run through the grouped MXFP4 kernels (the same rows and ``ends``), or the reference
    on their float32-dequantized block."""
    if use_kernels is None:
        use_kernels = moe_triton_available(rows.device)
    down_scaling = experts.scaling if experts.down_scaling is None else experts.down_scaling
    if isinstance(experts.gate_up, tuple) != isinstance(experts.down, tuple):
        raise ValueError("local experts: gate_up and down must both be MXFP4 (blocks, scales) or both tensors")
    if not use_kernels:
        return _local_experts_dense(rows, local_ids, weights, dequantized_experts(experts), down_scaling, capacity)
    return _local_experts_grouped(rows, local_ids, weights, experts, down_scaling, capacity)


def _overflow(local_ids: torch.Tensor, count: int, capacity: int | None) -> torch.Tensor:
    """Local pairs past ``capacity``, as an int64 on the device."""
    real = (local_ids < count).sum()
    return real.new_zeros(()) if capacity is None else (real - capacity).clamp(min=0)


def _local_experts_dense(
    rows: torch.Tensor,
    local_ids: torch.Tensor,
    weights: torch.Tensor,
    experts: LocalExperts,
    down_scaling: float,
    capacity: int | None,
) -> Partials:
    """The plain-PyTorch path, in float32 like :func:`~hone.kernels.moe_lora_reference.moe_experts_reference`:
    each local expert on every row, weighted by the row's weight for it (zero where the row did
    not choose it: exact). Slower than gathering each expert's rows, but its autograd graph does
    not depend on the routing: a rank whose experts got no row still runs the same backward, so
    every rank reaches the backward's exchanges. It computes every pair, so with a ``capacity``
    it only counts the pairs the kernels would have left out, for the same check."""
    layout = experts.layout
    x = rows.float()
    w_gu, w_dn = as_in_out(experts.gate_up, layout.transposed), as_in_out(experts.down, layout.transposed)
    out = torch.zeros_like(x)
    for e in range(experts.count):

        def pick(t, e=e):
            return None if t is None else t[e].float()

        gu_lora = None if experts.gate_up_lora is None else (pick(experts.gate_up_lora[0]), pick(experts.gate_up_lora[1]))
        dn_lora = None if experts.down_lora is None else (pick(experts.down_lora[0]), pick(experts.down_lora[1]))
        h = gated_activation(expert_projection(x, pick(w_gu), pick(experts.gate_up_bias), gu_lora, experts.scaling), layout)
        y = expert_projection(h, pick(w_dn), pick(experts.down_bias), dn_lora, down_scaling)
        coefficient = torch.where(local_ids == e, weights, 0.0).sum(dim=1, keepdim=True)
        out = out + coefficient * y
    return Partials(out.to(rows.dtype), _overflow(local_ids, experts.count, capacity))


class _WeightedRows(torch.autograd.Function):
    """``out[s] = sum_j w[s, j] * y[row of pair (s, j)]`` in float32, choices in order (a
    deterministic gather per choice, no atomics); pairs not among the computed rows read a zero
    row. Each computed row holds exactly one pair (``pair_of_row``; rows past the real pairs
    hold none), so the backward gathers its gradient ``w * grad`` from that pair's token instead
    of scattering every pair into a float32 buffer of all rows, and forms it for the first
    ``count`` rows only (the computed pairs: :func:`~hone.kernels.scaled_rows.scaled_rows`). Saves only ``y``, the indices
    and the weights (a plain gather would keep ``k`` float32 copies of ``y`` for the weights'
    gradient)."""

    @staticmethod
    def forward(
        ctx, y: torch.Tensor, weights: torch.Tensor, row_of_pair: torch.Tensor, pair_of_row: torch.Tensor, count: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(y, weights, row_of_pair, pair_of_row, count)
        return gather_rows_sum(y, row_of_pair, weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        y, weights, row_of_pair, pair_of_row, count = ctx.saved_tensors
        grad = grad.float()
        k = weights.shape[1]
        # pair_of_row is S' * k (one past the last pair: a zero weight) on rows holding no pair
        flat_weights = torch.cat([weights.reshape(-1), weights.new_zeros(1)])
        token = torch.div(pair_of_row, k, rounding_mode="floor")
        # the rows of computed pairs only (the first ``count``): the others are never read
        d_y = scaled_rows(grad, token, flat_weights[pair_of_row], count, y.dtype)
        padded = with_zero_row(y)
        d_w = torch.empty_like(weights)
        for j in range(k):
            d_w[:, j] = (padded[row_of_pair[:, j]].float() * grad).sum(dim=1)
        return d_y, d_w, None, None, None


def _local_experts_grouped(
    rows: torch.Tensor,
    local_ids: torch.Tensor,
    weights: torch.Tensor,
    experts: LocalExperts,
    down_scaling: float,
    capacity: int | None,
) -> Partials:
    """The grouped-kernel path: the received pairs sorted by local id (a stable sort, non-local
    choices last, their bucket dropped from ``ends``), the first ``capacity`` of them through
    both projections; each received row's pairs then weighted and summed. Sorted rows past the
    real pairs read a padding row appended to ``rows``: the kernels leave their outputs and input
    gradients unwritten, the outputs are never read, and the gradients land on that padding row,
    dropped, never on a real token's row."""
    n_rows, k = local_ids.shape
    count, layout = experts.count, experts.layout
    perm, ends_all = route(local_ids, count + 1)
    n_pairs = n_rows * k if capacity is None else min(capacity, n_rows * k)
    perm = perm[:n_pairs]
    ends = ends_all[:count].clamp(max=n_pairs)
    position = torch.arange(n_pairs, device=rows.device)
    real = position < ends[-1]
    token = torch.where(real, torch.div(perm, k, rounding_mode="floor"), n_rows)
    padded = with_zero_row(rows)
    # y's rows past the real pairs are left unwritten by the kernels and never read: every pair
    # that is not a computed row reads the zero row past y (forward), and gets no gradient.
    row_of_pair = torch.full((n_rows * k,), n_pairs, dtype=torch.int64, device=rows.device)
    row_of_pair[perm] = torch.where(real, position, n_pairs)
    # The gate/up input gradient gathers each received row's computed pairs (the padding row
    # none) instead of adding all N x S x k capacity rows atomically, most of them sentinels
    # piled onto the padding row: 1.4 ms a layer at N = 4 on the H100.
    readers = torch.cat([row_of_pair.view(n_rows, k), row_of_pair.new_full((1, k), n_pairs)])
    gate_up = _grouped_linear(
        padded, token, ends, experts.gate_up, layout, experts.gate_up_bias, experts.gate_up_lora, experts.scaling, readers
    )
    # the activation of the real pairs only: the capacity's other rows are never read
    h = gated_rows(gate_up, ends[-1:], layout)
    y = _grouped_linear(h, None, ends, experts.down, layout, experts.down_bias, experts.down_lora, down_scaling)
    pair_of_row = torch.where(real, perm, n_rows * k)
    out = _WeightedRows.apply(y, weights, row_of_pair.view(n_rows, k), pair_of_row, ends[-1:])
    overflow = (ends_all[count - 1].long() - n_pairs).clamp(min=0)
    return Partials(out.to(rows.dtype), overflow)


def _grouped_linear(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    ends: torch.Tensor,
    weight: torch.Tensor | MxExperts,
    layout: ExpertsLayout,
    bias: torch.Tensor | None,
    lora: LoraFactors | None,
    scaling: float,
    readers: torch.Tensor | None = None,
) -> torch.Tensor:
    """One projection of the sorted pairs: the bf16 grouped kernels, or the MXFP4 ones (which
    decode the weight tiles in registers; ``[E, out, in]`` whatever ``layout.transposed`` says).
    ``readers``: see :func:`~hone.kernels.moe_lora.moe_lora_linear`."""
    if isinstance(weight, tuple):
        return moe_mxfp4_linear(x, rows, ends, weight, bias, lora, scaling, readers=readers)
    return moe_lora_linear(x, rows, ends, weight, layout.transposed, bias, lora, scaling, readers)


def combine(partials: torch.Tensor, plan: SendPlan, shard: ExpertShard) -> torch.Tensor:
    """``[T, H]`` float32: the partial rows ``[N * S, H]`` (in received order) sent back to the
    ranks they came from, then each token's partials (one per rank holding any of its experts)
    summed in float32, in rank order."""
    back = exchange(partials, shard.size, shard.group)  # block d holds rank d's partials for our slots
    return gather_rows_sum(back, plan.slot)


def expert_parallel_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_local: torch.Tensor | MxExperts,
    down_local: torch.Tensor | MxExperts,
    layout: ExpertsLayout,
    shard: ExpertShard,
    biases: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    lora: tuple[LoraFactors | None, LoraFactors | None] | None = None,
    scaling: float = 1.0,
    down_scaling: float | None = None,
    capacity: int | None = None,
    use_kernels: bool | None = None,
    max_tokens: int | None = None,
    chunks: int = 1,
    recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], overflow [])``: the routed experts of ``hidden [T, H]`` (``top_k_index`` in
    global expert ids, ``top_k_weights [T, k]``) computed by the ranks holding them; ``out`` in
    ``hidden``'s dtype equals :func:`~hone.kernels.moe_lora_reference.moe_experts_reference` on
    all ``E`` experts. ``gate_up_local`` / ``down_local`` (and ``biases``, the LoRA factors in
    ``lora``) are this rank's ``[E / N, ...]`` blocks (:meth:`ExpertShard.local`). ``max_tokens``:
    the token slots per pair of ranks, the same on every rank (None: ``T``, so every rank must
    route as many tokens). MXFP4 experts: ``gate_up_local`` / ``down_local`` are ``(blocks,
    scales)`` blocks (:class:`LocalExperts`). ``capacity``: the pair rows of :func:`expert_capacity` (None: the worst
    case, nothing can overflow). ``overflow`` (int64, on the device) counts this rank's pairs
    that did not fit; the caller must refuse a step where any rank's is > 0.

    ``chunks``: the tokens go in this many consecutive chunks (:func:`token_chunks`), every chunk's
    exchanges issued before the first chunk's experts run and each chunk's combine right after its
    experts, so that the exchanges of one chunk can run while another computes (overlap, where
    the collectives are asynchronous: compiled, or NCCL). The same function: each token's rows,
    choices and partials are the unchunked ones, only the order of the expert gradients' sums
    differs. A capacity is split evenly over the chunks (rounded up to a multiple of 8).

    ``recompute``: the local experts run again in the backward (:func:`_recomputed`), so the
    capacity-sized buffers between the exchanges are not kept."""
    n_tokens, k = top_k_index.shape
    if hidden.dim() != 2 or hidden.shape[0] != n_tokens or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"expected hidden [T, H] with top_k_index and top_k_weights [T, k]; got {tuple(hidden.shape)}, "
            f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
        )
    for name, weight in (("gate_up_local", gate_up_local), ("down_local", down_local)):
        if _expert_count(weight) != shard.local_count:
            raise ValueError(
                f"{name} holds {_expert_count(weight)} experts; rank {shard.rank} of {shard.size} holds "
                f"{shard.local_count} of {shard.num_experts}"
            )
    gate_up_bias, down_bias = biases if biases is not None else (None, None)
    gate_up_lora, down_lora = lora if lora is not None else (None, None)
    experts = LocalExperts(
        gate_up_local, down_local, layout, gate_up_bias, down_bias, gate_up_lora, down_lora, scaling, down_scaling
    )
    run = _recomputed if recompute else local_experts
    if chunks == 1:
        sent = dispatch(hidden, top_k_index, top_k_weights, shard, max_tokens or n_tokens)
        partials = run(sent.rows, sent.local_ids, sent.weights, experts, capacity, use_kernels)
        return combine(partials.rows, sent.plan, shard).to(hidden.dtype), partials.overflow
    bounds, slots = token_chunks(n_tokens, max_tokens or n_tokens, chunks)
    per_chunk = None if capacity is None else _whole_blocks(-(-capacity // chunks))  # an even share
    # every chunk's exchanges first, then each chunk's experts and at once its way back
    sent = [dispatch(hidden[a:b], top_k_index[a:b], top_k_weights[a:b], shard, slots) for a, b in bounds]
    outs, overflow = [], None
    for chunk in sent:
        partials = run(chunk.rows, chunk.local_ids, chunk.weights, experts, per_chunk, use_kernels)
        outs.append(combine(partials.rows, chunk.plan, shard))
        overflow = partials.overflow if overflow is None else overflow + partials.overflow
    return torch.cat(outs).to(hidden.dtype), overflow


def _recomputed(
    rows: torch.Tensor,
    local_ids: torch.Tensor,
    weights: torch.Tensor,
    experts: LocalExperts,
    capacity: int | None,
    use_kernels: bool | None,
) -> Partials:
    """:func:`local_experts` under activation checkpointing: the backward keeps the received
    ``rows``, ids and weights only, and runs the experts' forward again before its own, with the
    same kernels on the same rows, so the gradients are those of the kept run. The exchanges stay
    outside: nothing travels twice. The experts' weights and LoRA factors are read from
    ``experts`` (a closure), which the checkpoint sees through."""

    def run(rows: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        partials = local_experts(rows, local_ids, weights, experts, capacity, use_kernels)
        return partials.rows, partials.overflow

    out, overflow = checkpoint(run, rows, local_ids, weights, use_reentrant=False)
    return Partials(out, overflow)


def token_chunks(n_tokens: int, max_tokens: int, chunks: int) -> tuple[list[tuple[int, int]], int]:
    """``([(start, end)] * chunks, slots)``: ``n_tokens`` split into ``chunks`` consecutive ranges
    of at most ``slots = ceil(max_tokens / chunks)`` tokens each, the same ``slots`` on every rank
    (``max_tokens`` is), so that the ranks' exchanges of chunk ``i`` match whatever each routes;
    a rank routing fewer than ``max_tokens`` may have short or empty last chunks."""
    if chunks < 1:
        raise ValueError(f"expert parallel: {chunks} token chunks; at least 1")
    if n_tokens > max_tokens:
        raise ValueError(f"{n_tokens} tokens routed here, more than the {max_tokens} the exchanges are sized for")
    slots = max(1, -(-max_tokens // chunks))
    return [(min(i * slots, n_tokens), min((i + 1) * slots, n_tokens)) for i in range(chunks)], slots


class ExpertCapacityError(HoneError):
    """Token-expert pairs did not fit the expert-parallel capacity: the step is refused, not run short."""


def check_overflow(overflow: torch.Tensor, capacity: int, shard: ExpertShard | None = None, share: int | None = None) -> None:
    """Refuse the step where pairs went over capacity: the one host sync of a step's overflow
    count (one layer's, the largest: :func:`~hone.models.experts.parallel.take_overflow`). With
    ``shard`` (``N > 1``) the largest over the group, so every rank raises together instead of
    one rank leaving the others waiting in the next collective. ``share``: the balanced share
    of pairs a capacity factor multiplies (``S x k``), to say in the error what share that
    layer received (its capacity plus its overflow: only where the layer's pairs went through
    one capacity, not split over chunks)."""
    worst = overflow.detach().to(torch.int64).reshape(())
    if shard is not None and shard.size > 1:
        worst = worst.clone()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=shard.group)
    dropped = int(worst)
    if not dropped:
        return
    received = ""
    if share:
        needed = capacity + dropped
        received = f" (it received {needed} pairs, {needed / share:.3f}x the balanced share of {share})"
    raise ExpertCapacityError(
        f"expert parallel: {dropped} token-expert pair(s) exceeded the capacity of {capacity} rows of a rank's experts "
        f"in one layer{received} and were not computed; raise the capacity factor, or leave it unset (the worst case "
        "never overflows)"
    )
