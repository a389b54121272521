"""How evenly a MoE model's router spreads one batch's (token, expert) pairs over expert-parallel ranks.

    python scripts/routing_balance.py --preset qwen3-30b-a3b --seq 4096 --ranks 2,4 [--out balance.md]

Expert parallelism over ``N`` ranks gives rank ``r`` the contiguous block of ``E / N`` experts
(:class:`hone.parallel.expert_parallel.ExpertShard`); every layer's exchanges wait for the rank
with the most pairs, so a layer costs its *busiest* rank's expert work. This script draws the
preset's random weights as a bench run does (:func:`hone.models.materialize.materialize`, seed 0),
runs one forward on the bench's random tokens, records each router's top-k choices and reports,
per ``N``, the busiest rank's pairs over the mean rank's, per layer and summed over the layers:
the share of expert time a perfectly balanced router would save. Not a benchmark, and a random
router is not a trained one (which a load-balancing loss keeps near 1.0).

``--device cpu --preset tiny-qwen3-moe`` is a dry run of the script itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def busiest_over_mean(choices: torch.Tensor, num_experts: int, ranks: int) -> float:
    """``choices [tokens, k]`` (global expert ids): the most pairs any of ``ranks`` contiguous
    expert blocks receives, over the mean block's."""
    per_expert = torch.bincount(choices.reshape(-1), minlength=num_experts).double()
    per_rank = per_expert.view(ranks, num_experts // ranks).sum(1)
    return float(per_rank.max() / per_rank.mean())


def router_choices(model: torch.nn.Module, ids: torch.Tensor, top_k: int) -> list[torch.Tensor]:
    """Each MoE layer's ``[tokens, top_k]`` choices for one forward of ``ids`` (in layer order),
    from its router's logits (the routers of transformers' MoE blocks are the ``mlp.gate`` linears
    or routers whose first output is the logits)."""
    recorded: list[torch.Tensor] = []

    def keep(_module, _inputs, output) -> None:
        logits = output[0] if isinstance(output, tuple) else output
        recorded.append(logits.reshape(-1, logits.shape[-1]).float().topk(top_k, dim=-1).indices.cpu())

    hooks = [m.register_forward_hook(keep) for name, m in model.named_modules() if name.endswith("mlp.gate")]
    if not hooks:
        raise SystemExit("no `mlp.gate` router found: not a MoE model hone knows")
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    return recorded


def report(choices: list[torch.Tensor], num_experts: int, ranks: list[int], title: str) -> str:
    """A markdown table: per rank count, the busiest rank's pairs over the mean rank's, over all
    layers (every layer's mean is the same ``tokens x k / N``, so the average of the layers'
    ratios is the summed busiest over the summed mean: the experts' time a step over a balanced
    router's), and the worst and best layer."""
    header = "| ranks | busiest / mean rank, all layers | worst layer | best layer |"
    lines = [f"# {title}", "", header, "|---|---|---|---|"]
    for n in ranks:
        per_layer = [busiest_over_mean(c, num_experts, n) for c in choices]
        total = sum(per_layer) / len(per_layer)
        lines.append(f"| {n} | {total:.3f} | {max(per_layer):.3f} | {min(per_layer):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from hone.bench.spec import parse_spec
    from hone.bench.worker import model_config_and_size, random_batches
    from hone.models.materialize import build_skeleton, materialize

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    workload = {"preset": args.preset, "sequence_len": args.seq, "micro_batch_size": 1}
    spec = parse_spec(
        {
            "name": "routing",
            "workload": workload | ({"layers": args.layers} if args.layers else {}),
            "conditions": [{"name": "hone"}],
        },
        "flags",
    )
    config, _, id_limit = model_config_and_size(spec.workload)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = materialize(build_skeleton(config, dtype), args.device).eval()
    ids = random_batches(spec.workload, 1, id_limit, 0, torch.device(args.device))[0]
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    choices = router_choices(model, ids, top_k)
    ranks = [n for n in (int(r) for r in args.ranks.split(",")) if num_experts % n == 0]
    title = f"routing balance: {args.preset}, {len(choices)} layers, {args.seq} random tokens, top-{top_k} of {num_experts}"
    text = report(choices, num_experts, ranks, title)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
