"""How evenly a MoE model's router spreads one batch's (token, expert) pairs over expert-parallel ranks.

    python scripts/routing_balance.py --preset qwen3-30b-a3b --seq 4096 --ranks 2,4
        [--preset-init sharp_attention] [--out balance.md]

Expert parallelism over ``N`` ranks gives rank ``r`` the contiguous block of ``E / N`` experts
(:class:`hone.parallel.expert_parallel.ExpertShard`); every layer's exchanges wait for the rank
with the most pairs, so a layer costs its *busiest* rank's expert work. This script draws the
preset's random weights as a bench run does (:func:`hone.models.materialize.materialize`, seed 0),
runs one forward on the bench's random tokens, records each router's top-k choices and reports,
per ``N``, the busiest rank's pairs over the mean rank's, per layer and summed over the layers:
the share of expert time a perfectly balanced router would save; then the same on a second batch
with each layer's experts placed by the first batch's load (what a load-aware placement could
recover without touching the router). Not a benchmark, and a random router is not a trained one
(which a load-balancing loss keeps near 1.0).

``--device cpu --preset tiny-qwen3-moe`` is a dry run of the script itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import get_args

import torch


def pairs_per_expert(choices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` float64: how many of ``choices [tokens, k]``'s (token, expert) pairs each expert receives."""
    return torch.bincount(choices.reshape(-1), minlength=num_experts).double()


def busiest_over_mean(choices: torch.Tensor, num_experts: int, ranks: int, owner: torch.Tensor | None = None) -> float:
    """``choices [tokens, k]`` (global expert ids): the most pairs any of ``ranks`` ranks receives,
    over the mean rank's. ``owner [E]``: the rank holding each expert (None: contiguous blocks
    of ``E / ranks``, hone's placement)."""
    per_expert = pairs_per_expert(choices, num_experts)
    if owner is None:
        owner = torch.arange(num_experts) // (num_experts // ranks)
    per_rank = torch.zeros(ranks, dtype=torch.float64).index_add_(0, owner, per_expert)
    return float(per_rank.max() / per_rank.mean())


def placed_by_load(choices: torch.Tensor, num_experts: int, ranks: int) -> torch.Tensor:
    """``owner [E]``: a placement of ``E / ranks`` experts a rank that evens out the pairs of
    ``choices`` (greedy: the busiest expert first, each to the least loaded rank with room), what
    a load-aware expert placement would do from routing statistics."""
    load = pairs_per_expert(choices, num_experts).tolist()
    per_rank, room = [0] * ranks, [num_experts // ranks] * ranks
    owner = torch.empty(num_experts, dtype=torch.long)
    for expert in sorted(range(num_experts), key=lambda e: -load[e]):
        rank = min((r for r in range(ranks) if room[r]), key=lambda r: per_rank[r])
        owner[expert], per_rank[rank], room[rank] = rank, per_rank[rank] + load[expert], room[rank] - 1
    return owner


def router_choices(model: torch.nn.Module, ids: torch.Tensor, top_k: int) -> tuple[list[torch.Tensor], list[float]]:
    """Each MoE layer's ``[tokens, top_k]`` choices for one forward of ``ids`` (in layer order),
    from its router's logits (the routers of transformers' MoE blocks are the ``mlp.gate`` linears
    or routers whose first output is the logits), and the mean cosine of the router's inputs to
    their batch mean: near 1 when every token's hidden state points the same way (the collapse
    that sends them all to the same experts, :mod:`hone.models.preset_init`)."""
    recorded: list[torch.Tensor] = []
    alike: list[float] = []

    def look(_module, inputs) -> None:
        hidden = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
        alike.append(float(torch.nn.functional.cosine_similarity(hidden, hidden.mean(0, keepdim=True), dim=-1).mean()))

    def keep(_module, _inputs, output) -> None:
        logits = output[0] if isinstance(output, tuple) else output
        recorded.append(logits.reshape(-1, logits.shape[-1]).float().topk(top_k, dim=-1).indices.cpu())

    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    if not routers:
        raise SystemExit("no `mlp.gate` router found: not a MoE model hone knows")
    hooks = [m.register_forward_pre_hook(look) for m in routers] + [m.register_forward_hook(keep) for m in routers]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    return recorded, alike


def report(
    choices: list[torch.Tensor], num_experts: int, ranks: list[int], title: str, later: list[torch.Tensor] | None = None
) -> str:
    """A markdown table: per rank count, the busiest rank's pairs over the mean rank's, over all
    layers (every layer's mean is the same ``tokens x k / N``, so the average of the layers'
    ratios is the summed busiest over the summed mean: the experts' time a step over a balanced
    router's), and the worst and best layer. With ``later`` (the choices of another batch): the
    same for that batch with each layer's experts placed by this batch's load (:func:`placed_by_load`)."""
    header = "| ranks | busiest / mean rank, all layers | worst layer | best layer |"
    header += " placed by load: all layers | worst layer |" if later else ""
    lines = [f"# {title}", "", header, "|" + "---|" * (header.count("|") - 1)]
    for n in ranks:
        per_layer = [busiest_over_mean(c, num_experts, n) for c in choices]
        row = f"| {n} | {_mean(per_layer):.3f} | {max(per_layer):.3f} | {min(per_layer):.3f} |"
        if later:
            placed = [
                busiest_over_mean(c, num_experts, n, placed_by_load(p, num_experts, n))
                for p, c in zip(choices, later, strict=True)
            ]
            row += f" {_mean(placed):.3f} | {max(placed):.3f} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def _busiest_expert(choices: torch.Tensor, num_experts: int) -> float:
    """The most pairs any one expert receives, over the mean expert's."""
    per_expert = pairs_per_expert(choices, num_experts)
    return float(per_expert.max() / per_expert.mean())


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    from hone.bench.spec import parse_spec
    from hone.bench.worker import model_config_and_size, random_batches
    from hone.config.model import PresetInit
    from hone.models.materialize import build_skeleton, materialize
    from hone.models.preset_init import apply_preset_init

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset-init", default="transformers", choices=get_args(PresetInit), help="model.preset_init")
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
    apply_preset_init(model, args.preset_init)
    first, second = random_batches(spec.workload, 2, id_limit, 0, torch.device(args.device))
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    (choices, alike), (later, _) = router_choices(model, first, top_k), router_choices(model, second, top_k)
    ranks = [n for n in (int(r) for r in args.ranks.split(",")) if num_experts % n == 0]
    title = (
        f"routing balance: {args.preset}, {len(choices)} layers, {args.seq} random tokens, top-{top_k} of {num_experts} "
        f"(placed by load: from the first batch's routing, measured on a second batch); preset_init {args.preset_init}"
    )
    text = report(choices, num_experts, ranks, title, later)
    text += (
        "\nrouter inputs' mean cosine to their batch mean, by layer: "
        + ", ".join(f"{a:.2f}" for a in alike[:8])
        + (f", ... last {alike[-1]:.2f}" if len(alike) > 8 else "")
        + f"; busiest expert over the mean expert, worst layer: {max(_busiest_expert(c, num_experts) for c in choices):.1f}\n"
    )
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
