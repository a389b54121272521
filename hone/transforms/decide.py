"""Every ``auto`` setting of a plan, resolved once: the :class:`~hone.transforms.base.Decisions`.

The planner calls :func:`decide` once per plan, before it asks any transform anything; each
transform then reads its setting from the plan (``ctx.decided``), and so do ``hone plan``'s
lines and the record. The order below is the order of their dependencies: the data-parallel
strategy says how many processes share the weights (the memory each card has left), the
checkpointing policy and the MLP tiling are decided together on that memory, the offload split
over the model's decoder layers and the host, and the tiled layers under both.
"""

from hone.config.root import HoneConfig
from hone.transforms.allocator import allocator_choice
from hone.transforms.auto_policy import offload_layers_choice, plan_memory
from hone.transforms.base import Decisions, RunFacts
from hone.transforms.data_parallel import resolve_strategy
from hone.transforms.memory.facts import model_facts
from hone.transforms.tiled_layers import decide_chunks


def decide(cfg: HoneConfig, facts: RunFacts) -> Decisions:
    """Resolve every ``auto`` setting of ``cfg`` for the run ``facts`` describe."""
    allocator = allocator_choice(cfg, facts.device.type)
    strategy, strategy_why = resolve_strategy(cfg, facts)
    param_shards = facts.world.world_size if strategy == "fsdp" else 1
    memory = plan_memory(cfg, facts.device, facts.memory_bytes, host_budget=facts.host_memory_bytes, param_shards=param_shards)
    chunks, chunks_why, chunks_do_not_fit = decide_chunks(cfg, facts, strategy, memory.policy, memory.shards, param_shards)
    offload_layers, offload_why = None, None
    if memory.policy == "offload":  # the split over the model's decoder layers, as the run finds them
        offload_layers, offload_why = offload_layers_choice(cfg, len(model_facts(cfg).layers), facts.host_memory_bytes)
    perf = cfg.performance
    inductor = perf.compiles_on(facts.device.type) and perf.torch_compile_backend == "inductor"
    by_compiler = memory.policy == "selective" and inductor
    return Decisions(
        strategy=strategy,
        strategy_why=strategy_why,
        param_shards=param_shards,
        expandable_segments=allocator.expandable,
        allocator_why=allocator.why,
        allocator_environment=allocator.user_setting,
        checkpointing=memory.policy,
        checkpointing_why=memory.policy_why,
        offload_layers=offload_layers,
        offload_why=offload_why,
        compiler_memory_budget=cfg.memory.selective_memory_budget if by_compiler else None,
        tiled_mlp_shards=memory.shards,
        tiled_mlp_why=memory.tiled_why,
        tiled_mlp_skipped=memory.tiled_why if cfg.memory.tiled_mlp == "auto" and memory.does_not_fit else None,
        tiled_layers_chunks=chunks,
        tiled_layers_why=chunks_why,
        tiled_layers_skipped=chunks_why if cfg.memory.tiled_layers == "auto" and chunks_do_not_fit and not chunks else None,
    )
