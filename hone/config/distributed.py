"""More than one process: how the model is replicated or sharded across ranks.

No torch here: the strategy is validated before anything is loaded. How many processes run is
not a config key: it is how the run was launched (``hone train CFG --nproc-per-node N`` or
``torchrun``), so the same config file trains on one GPU or on eight.
"""

from typing import Literal

from pydantic import model_validator

from hone.config.base import Section

Strategy = Literal["auto", "none", "ddp", "fsdp"]


class DistributedConfig(Section):
    """Data parallelism over the processes ``torchrun`` starts (docs/distributed.md)."""

    strategy: Strategy = "auto"
    """``ddp``: every rank holds the whole model, gradients are all-reduced. ``fsdp``: PyTorch's
    FSDP2 (``fully_shard`` per decoder layer and at the root) shards parameters, gradients and
    optimizer state across ranks. ``none``: refuse to run on more than one process. ``auto``:
    one process trains alone; on several, FSDP2 where the training state (weights, gradients,
    optimizer) does not fit one device, DDP otherwise (the plan prints which and why)."""

    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters of a layer after its forward and gather them again
    for the backward (less memory, one more all-gather per layer). ``false`` keeps them."""

    cpu_offload: bool = False
    """FSDP2: keep sharded parameters, gradients and optimizer state in host memory (the
    optimizer steps on the CPU): full fine-tunes that do not fit the GPUs, at a large cost in
    speed."""

    expert_parallel: int | Literal["auto"] = 1
    """Expert parallelism: the routed experts of every mixture-of-experts layer are split into
    ``N`` contiguous blocks, one per process of an expert-parallel group; each token travels to the processes holding its
    experts and back (two all-to-all exchanges per layer, no host syncs), and every other weight
    stays under the data-parallel strategy: DDP, or FSDP2 (``distributed.strategy: fsdp``, which
    then shards every weight outside the experts over all ranks: full fine-tunes of large MoE
    models). Use it for MoE models whose experts dominate the weights (qwen3-30b-a3b): each GPU
    holds ``E / N`` experts instead of all of them. ``1`` (the default): off. ``N`` must divide
    the number of processes ``W``: with ``N < W`` groups of ``N`` consecutive ranks split the
    experts and the ``W / N`` replicas of each block sum its gradients once per step (FSDP2,
    where asked, shards the rest over all ``W``). It needs hone's experts backend
    (``model.experts_implementation``: auto or hone); MXFP4 experts split like bf16 ones
    (docs/moe.md, docs/distributed.md). ``auto``: on one process 1; on several, the number of
    processes where the model has MoE layers hone's experts forward runs, the processes divide its
    experts, nothing else refuses expert parallelism, ``strategy`` is auto or ddp, and the
    replicated training state does not fit one device (where ``strategy: auto`` would pick FSDP2)
    but does with the experts split; 1 otherwise, DDP alone being faster where replicas fit
    (``hone plan --nproc-per-node N`` prints the choice). ``auto`` never picks expert parallelism
    beside FSDP2: set ``N`` and ``strategy: fsdp`` for that."""

    expert_capacity_factor: float | None = None
    """Expert parallelism: the token-expert pairs each rank's grouped kernels reserve rows for,
    per layer, as a multiple of the balanced share ``micro_batch_size x sequence_len x k``
    (rounded up to a multiple of 8). Unset (the default): the worst case, every received token's
    choices all on this rank, so nothing can overflow whatever the routing, at up to ``N`` times
    the expert-activation memory of one process. ``1.25`` or so keeps that memory near one
    process's; a micro-batch whose routing then overflows stops the run before its optimizer
    step with an error naming this key and the share of pairs the fullest layer received (a pair
    is never dropped silently); checkpoints do not depend on the factor, so the run continues
    from its last one with a larger factor (``training.resume: latest``). The exchanges
    themselves never overflow: a token travels at most once to each rank."""

    expert_parallel_chunks: int | Literal["auto"] = "auto"
    """Expert parallelism: each MoE layer exchanges its tokens in this many consecutive chunks,
    every chunk's dispatch issued first and each chunk's way back right after its experts, so the
    exchanges of one chunk can run while another chunk's experts compute. Exact (each token's rows
    are the unchunked ones; only the order of the expert gradients' sums differs). ``auto``: 1,
    one exchange each way, until ``hone bench`` shows chunks paying for their smaller GEMMs
    (measured without overlap: 2 chunks +7% a step at N = 4 on H200s; Inductor's reordering,
    ``performance.torch_compile_options: {reorder_for_compute_comm_overlap: true}``, which hone
    gives the passes that make it move the exchanges, is not measured on GPUs yet)."""

    expert_parallel_recompute: bool = False
    """Expert parallelism: recompute each MoE layer's local experts (the grouped GEMMs on the rows
    a rank received, between its two exchanges) in the backward instead of keeping their buffers
    from the forward. Those buffers are sized by the capacity: by default the worst case,
    ``N x T x min(k, E / N)`` pair rows a layer, up to ``N`` times one process's, and at ``N = 4``
    they make most of a rank's peak. Only the received rows are kept, and the exchanges are not
    repeated. It costs one more forward of the local experts a layer. Exact: the recomputed rows
    are the forward's. Measured on 4 H200 (qwen3-30b-a3b): a third off the peak at ``N = 4``, a
    fifth at ``N = 2``, for 22% more time a step; so ``false`` by default."""

    context_parallel: int = 1
    """Context parallelism: each sequence is split along its length over ``N`` consecutive ranks
    (DeepSpeed-Ulysses: every rank runs the projections, MLP, norms and loss on its contiguous
    ``1/N`` of the tokens; around attention two all-to-all exchanges give each rank the whole
    sequence for ``1/N`` of the heads, so any attention kernel, causal or packed with document
    isolation, keeps working). Use it when one sequence's activations do not fit one GPU even with
    checkpointing, offload and tiling (hundreds of thousands of tokens): each rank keeps about
    ``1/N`` of them (``hone plan --nproc-per-node N`` gives the longest sequence per GPU count).
    It costs two exchanges per attention layer each way, so at lengths one GPU holds, data
    parallelism is faster. ``1`` (the default): off. ``N`` must divide the number of processes ``W``
    (the ``W / N`` groups train different micro-batches: data parallelism, gradients summed over
    all ``W`` ranks by DDP or FSDP2) and the model's query and key/value heads; packed rows
    (``data.sample_packing``) need ``data.sequence_len`` a multiple of ``N`` (unpacked micro-batches
    are padded at the end of each row to a multiple of ``N``: no loss, exact). Not yet with
    ``expert_parallel`` or ``memory.tiled_layers`` (whose ``auto`` then leaves the layers whole;
    docs/distributed.md)."""

    @model_validator(mode="after")
    def _expert_parallel_alone(self) -> "DistributedConfig":
        ep = self.expert_parallel
        if ep != "auto" and ep < 1:
            raise ValueError(
                f"distributed.expert_parallel: {ep} must be at least 1 (1: off; N > 1: the experts "
                "split over N processes, N dividing the processes; auto: chosen by the run)"
            )
        cp = self.context_parallel
        if cp < 1:
            raise ValueError(
                f"distributed.context_parallel: {cp} must be at least 1 (1: off; N > 1: each sequence split over N "
                "processes, N dividing the processes)"
            )
        if cp > 1 and ep != "auto" and ep > 1:
            raise ValueError(
                f"distributed.context_parallel: {cp} and distributed.expert_parallel: {ep} cannot be combined yet "
                "(each would shard the tokens of a micro-batch its own way): set one of them to 1"
            )
        if cp > 1 and self.strategy == "none":
            raise ValueError(
                f"distributed.context_parallel: {cp} runs on several processes, which distributed.strategy: none "
                "refuses: use distributed.strategy: auto, ddp or fsdp, or distributed.context_parallel: 1"
            )
        factor = self.expert_capacity_factor
        if factor is not None and not factor > 0:
            raise ValueError(f"distributed.expert_capacity_factor: {factor} must be a positive number (or unset: no overflow)")
        if factor is not None and self.expert_parallel == 1:
            raise ValueError(
                f"distributed.expert_capacity_factor: {factor} sizes the exchanges of expert parallelism, which is off "
                "(distributed.expert_parallel: 1): set expert_parallel, or remove expert_capacity_factor"
            )
        chunks = self.expert_parallel_chunks
        if chunks != "auto" and chunks < 1:
            raise ValueError(f"distributed.expert_parallel_chunks: {chunks} must be at least 1 (or auto)")
        if chunks != "auto" and chunks > 1 and self.expert_parallel == 1:
            raise ValueError(
                f"distributed.expert_parallel_chunks: {chunks} splits the exchanges of expert parallelism, which is off "
                "(distributed.expert_parallel: 1): set expert_parallel, or remove expert_parallel_chunks"
            )
        if self.expert_parallel_recompute and self.expert_parallel == 1:
            raise ValueError(
                "distributed.expert_parallel_recompute: true recomputes the local experts of expert parallelism, which "
                "is off (distributed.expert_parallel: 1): set expert_parallel, or remove expert_parallel_recompute"
            )
        if ep != "auto" and ep > 1 and self.strategy == "none":
            raise ValueError(
                f"distributed.expert_parallel: {self.expert_parallel} runs on several processes, which "
                "distributed.strategy: none refuses: use distributed.strategy: auto, ddp or fsdp, "
                "or distributed.expert_parallel: 1"
            )
        return self
