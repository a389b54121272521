"""Expert parallelism over part of the job: what each of 4 gloo ranks runs with
``distributed.expert_parallel: 2`` (2 expert-parallel groups {0, 1} and {2, 3}, each block of
experts held by 2 replicas), imported by tests/distributed/test_expert_parallel_groups.py.

Each case trains 3 steps with a checkpoint after step 2 and writes its final output; then the
same case again from that checkpoint in a model whose trained weights were scrambled first. The
trained weights of every rank and the expert groups' layout go to files for the test."""

from pathlib import Path

import torch
from ep_training import Case, expert_parallel_model, make_config, run, scramble_trainable, trainable

from hone.models.experts.parallel import expert_parallel_shards
from hone.models.experts.sharded_state import gathers

EXPERT_PARALLEL = 2


def groups_ranks(rank: int, out: Path, seed: int, cases: list[Case]) -> None:
    """Each case whole and resumed on this rank (accumulation 1, ``expert_parallel: 2``)."""
    import torch.distributed as dist

    from hone.runtime.world import current_world
    from hone.train.checkpoint_io import checkpoint_io_for
    from hone.transforms.base import RunFacts

    world = current_world()
    facts = RunFacts(torch.device("cpu"), world=world)
    for case in cases:
        for part in ("whole", "resumed"):
            where = out / case.name / part
            cfg = make_config(where, case, accumulation=1, expert_parallel=EXPERT_PARALLEL, save_steps=2)
            model = expert_parallel_model(case, seed, cfg, facts)
            resume_from = None
            if part == "resumed":
                scramble_trainable(model, rank)
                resume_from = out / case.name / "whole" / "checkpoints" / "step-2"
            hooks = run(model, cfg, world, facts, seed, resume_from=resume_from)
            checkpoint_io_for(hooks, world).save_final(model, None, where / "final", cfg.adapter)
            shards = expert_parallel_shards(model)
            shard = next(iter(shards.values()))
            layout = {
                "ep_rank": shard.rank,
                "ep_size": shard.size,
                "group": dist.get_process_group_ranks(shard.group),
                "replicas": dist.get_process_group_ranks(shard.replicas),
                "gathers": gathers(shard),
            }
            saved = {"weights": trainable(model), "sharded": {n: s.local_count for n, s in shards.items()}, "layout": layout}
            torch.save(saved, where / f"weights-rank{rank}.pt")


def resume_on_two_ranks(rank: int, out: Path, seed: int, case: Case, checkpoint: Path) -> None:
    """On 2 ranks (one group of 2, accumulation 2: the same global batch), ``case`` from the
    4-rank checkpoint ``checkpoint``, in a model whose trained weights were scrambled first."""
    from hone.runtime.world import current_world
    from hone.train.checkpoint_io import checkpoint_io_for
    from hone.transforms.base import RunFacts

    world = current_world()
    facts = RunFacts(torch.device("cpu"), world=world)
    cfg = make_config(out, case, accumulation=2, expert_parallel=EXPERT_PARALLEL, save_steps=2)
    model = expert_parallel_model(case, seed, cfg, facts)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(rank)))
    hooks = run(model, cfg, world, facts, seed, resume_from=checkpoint)
    checkpoint_io_for(hooks, world).save_final(model, None, out / "final", cfg.adapter)
    sharded = {n: s.local_count for n, s in expert_parallel_shards(model).items()}
    torch.save({"weights": trainable(model), "sharded": sharded}, out / f"weights-rank{rank}.pt")


def replica_sums(rank: int, out: Path) -> None:
    """:func:`~hone.parallel.groups.sum_over_replicas` over 2 ranks with buckets of 64 bytes:
    gradients of two dtypes, one larger than a bucket, one not contiguous; every rank's results."""
    import torch.distributed as dist

    from hone.parallel import groups

    groups.BUCKET_BYTES = 64  # our own constant: several buckets, and one gradient alone, in place
    gen = torch.Generator().manual_seed(rank)
    grads = [
        torch.randn(3, 2, generator=gen),
        torch.randn(40, generator=gen),  # 160 bytes: larger than a bucket, reduced alone
        torch.randn(4, 3, generator=gen).t(),  # not contiguous
        torch.randn(5, generator=gen).to(torch.float64),
        torch.randn(2, 2, generator=gen),
    ]
    before = [g.clone() for g in grads]
    groups.sum_over_replicas(grads, dist.new_group([0, 1]))
    torch.save({"before": before, "after": grads}, out / f"sums-rank{rank}.pt")
