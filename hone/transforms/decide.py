"""Every ``auto`` setting of a plan, resolved once: the :class:`~hone.transforms.base.Decisions`.

The planner calls :func:`decide` once per plan, before it asks any transform anything; each
transform then reads its setting from the plan (``ctx.decided``), and so do ``hone plan``'s
lines and the record. Under context parallelism every memory decision is made for one rank's
shard of each sequence (:func:`~hone.transforms.context_parallel.per_rank_config`) and its share
of the host (:func:`~hone.transforms.context_parallel.per_rank_facts`), layer runs included. The order below
is the order of their dependencies: expert parallelism
(the model and the processes; the memory estimates below see the experts split as it decides),
whether the model compiles and which experts implementation it runs (the device and the model),
the data-parallel strategy, which says how many processes share the weights (the memory each card
has left), the checkpointing policy and the MLP tiling, decided together on that memory, the
compiler's memory budget for ``selective``, the offload split over the model's decoder layers
and the host, the tiled layers under both, and last CUDA graphs, which are safe and worth it
only under some of those choices.
"""

from dataclasses import replace

import torch

from hone.config.root import HoneConfig
from hone.runtime.world import SINGLE, World
from hone.transforms.allocator import allocator_choice
from hone.transforms.auto_policy import offload_layers_choice, plan_memory, selective_budget_choice
from hone.transforms.base import Decisions, RunFacts
from hone.transforms.card import host_memory
from hone.transforms.compile import compile_choice
from hone.transforms.context_parallel import per_rank_config, per_rank_facts
from hone.transforms.cuda_graphs import cuda_graphs_choice
from hone.transforms.data_parallel import resolve_strategy
from hone.transforms.expert_parallel import TILING_HELD_OFF, expert_parallel_choice, untiled_per_rank, with_expert_parallel
from hone.transforms.experts import experts_choice
from hone.transforms.fp8_sizes import float8_lora_base, fp8_scaling, with_fp8_base_linears
from hone.transforms.layer_runs import decide_run_layers
from hone.transforms.memory.decide import loss_of
from hone.transforms.memory.estimate import MemoryEstimate, estimate_memory
from hone.transforms.memory.facts import model_facts
from hone.transforms.memory.knobs import Knobs
from hone.transforms.prompt_sharing import pair_rows_config, share_prompt_choice
from hone.transforms.tiled_layers import decide_chunks


def decide(cfg: HoneConfig, facts: RunFacts) -> Decisions:
    """Resolve every ``auto`` setting of ``cfg`` for the run ``facts`` describe. Where
    ``expert_parallel: auto`` split the experts but the memory then needs a tiled MLP or tiled
    layers (which expert parallelism refuses), the plan is decided again without it."""
    expert_parallel, why = expert_parallel_choice(cfg, facts)
    decided = _decide_base_linears(cfg, facts, expert_parallel, why)
    tiled = decided.tiled_mlp_shards > 0 or decided.tiled_layers_chunks >= 2
    if expert_parallel > 1 and cfg.distributed.expert_parallel == "auto" and tiled:
        why = f"distributed.expert_parallel: auto: 1, the activations need tiling, which expert parallelism refuses ({why})"
        decided = _decide_base_linears(cfg, facts, 1, why)
    return decided


#: The measurement ``fp8_base_linears: auto`` rests on (benchmarks/2026-11-29-h200-fp8.md).
_MEASURED_BASE_LINEARS = (
    "qwen3-8b LoRA q,k,v,o at seq 2048 on an H200: all 94.5 ms a step with CUDA graphs; "
    "without them lora_targets 120.6 ms, all 146.9"
)


def _decide_base_linears(cfg: HoneConfig, facts: RunFacts, expert_parallel: int, expert_parallel_why: str) -> Decisions:
    """:func:`_decide`, with ``fp8_base_linears: auto`` resolved: every frozen linear in float8
    where the plan then replays the step as CUDA graphs (the memory of the extra float8 copies
    counted), else the LoRA targets only (without graphs the step is host-bound, and each
    converted linear adds launches)."""
    asked = cfg.performance.fp8_base_linears
    if not float8_lora_base(cfg):  # no float8 LoRA base: nothing reads the setting
        return _decide(cfg, facts, expert_parallel, expert_parallel_why)
    if asked != "auto":
        decided = _decide(cfg, facts, expert_parallel, expert_parallel_why)
        return replace(decided, fp8_base_linears=asked, fp8_base_linears_why=f"performance.fp8_base_linears: {asked}")
    every = _decide(with_fp8_base_linears(cfg, "all"), facts, expert_parallel, expert_parallel_why)
    if every.cuda_graphs:
        why = f"performance.fp8_base_linears: auto: all, CUDA graphs replay the step ({_MEASURED_BASE_LINEARS})"
        return replace(every, fp8_base_linears="all", fp8_base_linears_why=why)
    decided = _decide(with_fp8_base_linears(cfg, "lora_targets"), facts, expert_parallel, expert_parallel_why)
    why = (
        "performance.fp8_base_linears: auto: lora_targets, every frozen linear in float8 would run without CUDA graphs "
        f"({every.cuda_graphs_why.removeprefix('cuda_graphs: auto: off, ')}; {_MEASURED_BASE_LINEARS})"
    )
    return replace(decided, fp8_base_linears="lora_targets", fp8_base_linears_why=why)


def _decide(cfg: HoneConfig, facts: RunFacts, expert_parallel: int, expert_parallel_why: str) -> Decisions:
    """Every other ``auto`` setting, the experts split over ``expert_parallel`` ranks; under
    context parallelism the memory is decided for one rank's shard of each sequence."""
    context_parallel = cfg.distributed.context_parallel
    facts = per_rank_facts(cfg, facts)  # the group's ranks share the host
    asked, cfg = cfg, _per_rank(cfg, expert_parallel)
    allocator = allocator_choice(cfg, facts.device.type)
    compiles, compile_why = compile_choice(cfg, facts)
    experts, experts_why = experts_choice(cfg, facts, expert_parallel)
    share_prompt, prompt_kernel, share_prompt_why = share_prompt_choice(cfg, facts, compiles)
    rows = pair_rows_config(cfg, facts, share_prompt)  # the rows as wide as the data's pairs make them
    pair_sequence_len, cfg = (rows.data.sequence_len if rows is not cfg else None), rows
    strategy, strategy_why = resolve_strategy(cfg, facts, expert_parallel)
    param_shards = facts.world.world_size if strategy == "fsdp" else 1
    fp8, fp8_why = fp8_scaling(cfg, fsdp=strategy == "fsdp")
    memory = plan_memory(cfg, facts.device, facts.memory_bytes, host_budget=facts.host_memory_bytes, param_shards=param_shards)
    chunks, chunks_why, chunks_do_not_fit = decide_chunks(cfg, facts, strategy, memory.policy, memory.shards, param_shards)
    runs = decide_run_layers(
        cfg, facts, memory.policy, (memory.shards, chunks), strategy=strategy, expert_parallel=expert_parallel
    )
    shards, tiled_mlp_why = memory.shards, memory.tiled_why
    if runs.tiling_why is not None:  # the runs fit only tiled: auto tiling left off alone comes on with them
        if runs.mlp_shards != shards:
            shards, tiled_mlp_why = runs.mlp_shards, f"tiled_mlp: auto: {runs.mlp_shards} shards, {runs.tiling_why}"
        if runs.chunks != chunks:
            chunks, chunks_why = runs.chunks, f"tiled_layers: auto: {runs.chunks} chunks, {runs.tiling_why}"
    tiled_mlp_why, chunks_why = _held_off(asked, cfg, shards, chunks, tiled_mlp_why, chunks_why)
    offload_layers, offload_why = _offload_split(cfg, facts, memory.policy, runs.layers)
    budget, budget_why = None, None
    if memory.policy == "selective" and compiles and cfg.performance.torch_compile_backend == "inductor":
        budget, budget_why = selective_budget_choice(
            cfg, facts.device, memory.shards, facts.memory_bytes, host_budget=facts.host_memory_bytes, param_shards=param_shards
        )
    cuda_graphs, cuda_graphs_why = cuda_graphs_choice(
        cfg,
        facts,
        compiles=compiles,
        experts=experts,
        strategy=strategy,
        policy=memory.policy,
        tiled=bool(shards or chunks),
        expert_parallel=expert_parallel,
    )
    return Decisions(
        strategy=strategy,
        strategy_why=strategy_why,
        param_shards=param_shards,
        expandable_segments=allocator.expandable,
        allocator_why=allocator.why,
        allocator_environment=allocator.user_setting,
        compile=compiles,
        compile_why=compile_why,
        experts_implementation=experts,
        experts_why=experts_why,
        cuda_graphs=cuda_graphs,
        cuda_graphs_why=cuda_graphs_why,
        checkpointing=memory.policy,
        checkpointing_why=memory.policy_why,
        offload_layers=offload_layers,
        offload_why=offload_why,
        compiler_memory_budget=budget,
        compiler_memory_budget_why=budget_why,
        tiled_mlp_shards=shards,
        tiled_mlp_why=tiled_mlp_why,
        tiled_mlp_skipped=memory.tiled_why if cfg.memory.tiled_mlp == "auto" and memory.does_not_fit and not shards else None,
        tiled_layers_chunks=chunks,
        tiled_layers_why=chunks_why,
        tiled_layers_skipped=chunks_why if cfg.memory.tiled_layers == "auto" and chunks_do_not_fit and not chunks else None,
        expert_parallel=expert_parallel,
        expert_parallel_why=expert_parallel_why,
        context_parallel=context_parallel,
        run_layers=runs.layers,
        run_layers_why=runs.why,
        share_prompt=share_prompt,
        share_prompt_kernel=prompt_kernel,
        share_prompt_why=share_prompt_why,
        pair_sequence_len=pair_sequence_len,
        fp8=fp8,
        fp8_why=fp8_why,
    )


def _per_rank(cfg: HoneConfig, expert_parallel: int) -> HoneConfig:
    """``cfg`` as one rank's ``auto`` decisions see it: the experts split as decided, context
    parallelism's shard, and under an expert parallelism the user asked for, no tiling
    (:func:`untiled_per_rank`). Under ``expert_parallel: auto`` tiling stays possible, and
    :func:`decide` takes expert parallelism back where the memory then needs it."""
    split = per_rank_config(with_expert_parallel(cfg, expert_parallel))
    return split if cfg.distributed.expert_parallel == "auto" else untiled_per_rank(split)


def _held_off(asked: HoneConfig, cfg: HoneConfig, shards: int, chunks: int, mlp_why: str, layers_why: str) -> tuple[str, str]:
    """The reasons for the tiled MLP and tiled layers where :func:`untiled_per_rank` turned the
    user's ``auto`` off (``cfg``: the config decided on; ``asked``: the user's), not the
    ``off`` that config now says."""
    if asked.distributed.expert_parallel in ("auto", 1):
        return mlp_why, layers_why
    if asked.memory.tiled_mlp == "auto" and cfg.memory.tiled_mlp == "off" and not shards:
        mlp_why = f"tiled_mlp: auto: off, {TILING_HELD_OFF}"
    if asked.memory.tiled_layers == "auto" and cfg.memory.tiled_layers == "off" and not chunks:
        layers_why = f"tiled_layers: auto: off, {TILING_HELD_OFF}"
    return mlp_why, layers_why


def _offload_split(cfg: HoneConfig, facts: RunFacts, policy: str, run_layers: int) -> tuple[int | None, str | None]:
    """``offload``: how many of the model's decoder layers (runs of ``run_layers``) put their
    saved input on the host, and why, as the run finds them; (None, None) under another policy."""
    if policy != "offload":
        return None, None
    layers = len(model_facts(cfg).layers)
    offload_layers, why = offload_layers_choice(cfg, -(-layers // run_layers), facts.host_memory_bytes)
    return offload_layers, f"{why} (runs of {run_layers} layers, one input each)" if run_layers > 1 else why


def decided_estimate(
    cfg: HoneConfig,
    device: str = "cuda",
    host_budget: int | None = None,
    world: World = SINGLE,
    memory_bytes: int | None = None,
    pair_splits: tuple = (),
) -> MemoryEstimate:
    """The memory estimate of the step ``cfg`` runs on ``device`` (one process of ``world``: its
    share of FSDP2's shards, its block of the experts; the card is ``memory_bytes`` or the local
    one, the host ``host_budget`` or this machine's RAM), every ``auto`` setting as the plan decides it: the
    bench records it beside each measured peak, so it must estimate what runs (a world of one
    would estimate FSDP2 alone on N GPUs as one unsharded process; ``pair_splits``: a preference
    run's data statistics, as the run has them)."""
    if host_budget is None:
        host_budget = host_memory(None)[0]
    if memory_bytes is None and device != "cpu":
        memory_bytes = cfg.memory.gpu_memory_bytes  # the card the run plans for (None: the local one)
    facts = RunFacts(
        torch.device(device), memory_bytes=memory_bytes, host_memory_bytes=host_budget, world=world, pair_splits=pair_splits
    )
    decided = decide(cfg, facts)
    host_budget = per_rank_facts(cfg, facts).host_memory_bytes  # under context parallelism: one rank's share
    knobs = Knobs(
        decided.checkpointing,
        loss_of(cfg),
        device=device,
        compiled=decided.compile,
        tiled_mlp=decided.tiled_mlp_shards,
        tiled_layers=decided.tiled_layers_chunks,
        offload_layers=decided.offload_layers,
        selective_budget=decided.compiler_memory_budget,
        host_budget=host_budget,
        run_layers=decided.run_layers,
        param_shards=decided.param_shards,
    )
    return estimate_memory(as_decided(cfg, decided), knobs)


def as_decided(cfg: HoneConfig, decided: Decisions) -> HoneConfig:
    """``cfg`` with the decided values the memory estimates read from the config: the experts
    split over ``expert_parallel`` ranks, the float8 base's linears, a preference run's pair rows."""
    cfg = with_fp8_base_linears(with_expert_parallel(cfg, decided.expert_parallel), decided.fp8_base_linears)
    if decided.pair_sequence_len is None:
        return cfg
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"sequence_len": decided.pair_sequence_len})})
