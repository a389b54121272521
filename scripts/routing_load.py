"""How evenly a MoE model's routers spread tokens over experts and over expert-parallel ranks.

    python scripts/routing_load.py --preset qwen3-30b-a3b --layers 4 --seq 4096 --sequences 2

Builds the preset as ``hone bench`` does (transformers' random init; ``--layers`` keeps the
first layers only, so the 48-layer preset's first four fit a CPU in float32), runs random tokens
through it without gradients and prints, per MoE layer, the busiest expert's share against the
mean and, for expert parallel sizes 2, 4 and 8, the busiest rank's pairs against the mean rank's
(each rank holding a contiguous block of ``E / N`` experts, as ``distributed.expert_parallel``
splits them). Under expert parallelism every layer waits for its busiest rank, so that ratio
bounds what the grouped GEMMs of a step can gain from the split. A trained router with a
load-balancing loss keeps it near 1; a random-weight model need not (its attention averages the
values of the whole context into a component every token shares, which tilts every router the
same way). Not a benchmark; no timings.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM

from hone.models.presets import build_preset_config


def expert_counts(indices: torch.Tensor, experts: int) -> torch.Tensor:
    """Pairs per expert from ``indices [tokens, k]`` (float, for the ratios)."""
    return torch.bincount(indices.reshape(-1), minlength=experts).float()


def rank_ratio(counts: torch.Tensor, ranks: int) -> float:
    """The busiest of ``ranks`` contiguous expert blocks' pairs over the mean block's."""
    per_rank = counts.view(ranks, -1).sum(1)
    return (per_rank.max() / per_rank.mean()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4, help="the first this many decoder layers (default 4)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--sequences", type=int, default=2, help="random sequences (default 2)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    config = build_preset_config(args.preset, {"num_hidden_layers": args.layers}, vocab_size=None)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    experts, top_k = config.num_experts, config.num_experts_per_tok
    picked: dict[int, list[torch.Tensor]] = {}

    def keep(layer: int):
        def hook(module, inputs, output):  # transformers' top-k router: (logits, scores, indices)
            picked.setdefault(layer, []).append(output[-1].reshape(-1, top_k).cpu())

        return hook

    for i, layer in enumerate(model.model.layers):
        router = getattr(getattr(layer, "mlp", None), "gate", None)
        if router is not None and hasattr(layer.mlp, "experts"):
            router.register_forward_hook(keep(i))
    if not any(hasattr(getattr(layer, "mlp", None), "experts") for layer in model.model.layers):
        raise SystemExit(f"{args.preset}: no MoE layer among the first {args.layers}")
    with torch.no_grad():
        for _ in range(args.sequences):
            model.model(input_ids=torch.randint(0, config.vocab_size, (1, args.seq), device=args.device))
    sizes = [n for n in (2, 4, 8) if experts % n == 0]
    print(
        f"{args.preset}, first {args.layers} layers, {args.sequences} x {args.seq} random tokens, {experts} experts, top-{top_k}"
    )
    print("| layer | busiest expert / mean | " + " | ".join(f"busiest of {n} ranks / mean" for n in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for layer in sorted(picked):
        counts = expert_counts(torch.cat(picked[layer]), experts)
        ratios = " | ".join(f"{rank_ratio(counts, n):.2f}" for n in sizes)
        print(f"| {layer} | {(counts.max() / counts.mean()).item():.1f} | {ratios} |")


if __name__ == "__main__":
    main()
