"""The longest sequence each memory policy fits, on the card and in the host's memory.

Why: at long context the question is not "does this config fit" but "how far does each switch
take me": checkpointing (none/selective/full/offload), the tiled MLP and the fused loss each
remove a different term that grows with the sequence, and offloading moves the layers' inputs
to host memory, which is finite too. :func:`longest_table` answers it for every combination
from the estimate alone (:mod:`hone.transforms.memory`), so ``hone plan`` prints it without a
GPU, and ``hone bench``'s ``longest`` kind measures the same thing.
"""

from dataclasses import dataclass, replace

from hone.config.memory import INPUT_ONLY_POLICIES, POLICIES_BY_SPEED
from hone.config.root import HoneConfig
from hone.transforms.memory.estimate import MemoryEstimate, estimate_memory
from hone.transforms.memory.knobs import Knobs, LossKind
from hone.transforms.memory.longest import longest_sequence
from hone.units import GIB, gib

#: Granularity of the search: sequences are multiples of this.
MULTIPLE = 1024

#: No search goes beyond this many tokens (16M).
LIMIT = 1 << 24

#: Layer-run lengths the table tries (``memory.checkpoint_run_layers``), beside one input per layer.
RUN_LENGTHS = (2, 3)


@dataclass(frozen=True)
class LongestRow:
    """One combination and the longest sequence it fits (0: not even :data:`MULTIPLE`)."""

    checkpointing: str
    tiled: bool
    loss: LossKind
    longest: int
    at_longest: MemoryEstimate | None
    """The estimate at ``longest`` (GPU peak, host memory, the offload split)."""
    layers_tiled: bool = False
    """``memory.tiled_layers: auto``: each layer in sequence chunks (full and offload only)."""
    run_layers: int = 1
    """``memory.checkpoint_run_layers``: one saved input per run of this many layers (full and offload only)."""


def longest_table(
    cfg: HoneConfig,
    budget: int,
    host_budget: int | None,
    *,
    device: str = "cuda",
    losses: tuple[LossKind, ...] = ("standard", "fused_linear_ce"),
    param_shards: int = 1,
    context_parallel: int | None = None,
) -> list[LongestRow]:
    """For every checkpointing policy x tiled MLP (off, ``auto``'s shard count at each length) x
    loss in ``losses``, and for ``full`` and ``offload`` with tiled layers too (``auto``'s chunk
    count, tiled MLP, the last loss of ``losses``): the longest sequence whose estimated GPU peak fits ``budget`` bytes and
    whose host memory fits ``host_budget`` (None: unlimited), with ``offload_layers`` as the
    config sets it (``auto``: the split that fits the host). Offload only on CUDA.
    ``context_parallel``: each sequence split over that many ranks (default: as the config says;
    then the rows are one rank's, and tiled layers, which context parallelism refuses, are left
    out: its layer runs are tried without them)."""
    split = context_parallel or cfg.distributed.context_parallel
    combos: list[tuple[str, bool, LossKind, bool, int]] = []
    for policy in POLICIES_BY_SPEED:
        if policy == "offload" and device != "cuda":
            continue
        combos += [(policy, tiled, loss, False, 1) for tiled in (False, True) for loss in losses]
        if policy in INPUT_ONLY_POLICIES and split == 1:  # tiled layers, then layer runs with them: the furthest only
            combos += [(policy, True, losses[-1], True, runs) for runs in (1, *RUN_LENGTHS)]
        elif policy in INPUT_ONLY_POLICIES:  # split: layer runs without tiled layers (refused beside context parallelism)
            combos += [(policy, True, losses[-1], False, runs) for runs in RUN_LENGTHS]
    rows = []
    for policy, tiled, loss, layers_tiled, runs in combos:
        knobs = Knobs(
            policy,
            loss,
            device=device,
            tiled_mlp="auto" if tiled else 0,
            host_budget=host_budget,
            param_shards=param_shards,
            tiled_layers="auto" if layers_tiled else 0,
            context_parallel=split,
            run_layers=runs,
        )
        longest = longest_sequence(cfg, knobs, budget, multiple=MULTIPLE, limit=LIMIT)
        at = estimate_memory(cfg, replace(knobs, sequence_len=longest)) if longest else None
        rows.append(LongestRow(policy, tiled, loss, longest, at, layers_tiled, runs))
    return rows


def _offloaded(row: LongestRow, est: MemoryEstimate | None) -> str:
    """The offload split's cell: layers, or with layer runs, runs (one input each) of the layers."""
    if row.checkpointing != "offload" or est is None:
        return "-"
    if row.run_layers > 1:
        return f"{est.offloaded_layers}/{-(-est.layers // row.run_layers)} runs"
    return f"{est.offloaded_layers}/{est.layers}"


def best_row(rows: list[LongestRow]) -> LongestRow | None:
    """The combination that reaches furthest (None when nothing fits)."""
    fitting = [r for r in rows if r.longest]
    return max(fitting, key=lambda r: r.longest) if fitting else None


def render_longest(
    rows: list[LongestRow], budget: int, host_budget: int | None, host_source: str, memory: str = "GPU"
) -> list[str]:
    """Lines of the table ``hone plan`` prints (GiB; host = the process's resident memory;
    ``memory``: what the budget is, ``GPU`` or, on a CPU run, ``memory``)."""
    host = f"{host_budget / GIB:.0f} GiB host ({host_source})" if host_budget else "unlimited host memory"
    out = [f"Longest sequence that fits {gib(budget)} of {memory} and {host} (estimate, micro-batch as configured):"]
    header = [
        "checkpointing",
        "tiled MLP",
        "tiled layers",
        "layer runs",
        "loss",
        "longest",
        f"{memory} peak",
        "host",
        "layers offloaded",
    ]
    table = []
    for r in rows:
        est = r.at_longest
        table.append(
            [
                r.checkpointing,
                f"auto ({est.tiled_mlp})" if r.tiled and est is not None else ("auto" if r.tiled else "off"),
                f"auto ({est.tiled_layers})" if r.layers_tiled and est is not None else ("auto" if r.layers_tiled else "off"),
                str(r.run_layers),
                r.loss,
                f"{r.longest:,}" if r.longest else "none",
                f"{est.total / GIB:.1f}" if est else "-",
                f"{est.host_total / GIB:.1f}" if est else "-",
                _offloaded(r, est),
            ]
        )
    widths = [max(len(x[i]) for x in [header, *table]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return ("  " + "  ".join(c.ljust(w) if i < 5 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))).rstrip()

    out += [line(header), "  " + "  ".join("-" * w for w in widths), *(line(x) for x in table)]
    best = best_row(rows)
    if best is not None:
        out.append(
            f"  furthest: {best.longest:,} tokens with checkpointing {best.checkpointing}, tiled MLP "
            f"{'auto' if best.tiled else 'off'}, tiled layers {'auto' if best.layers_tiled else 'off'}, "
            f"{best.run_layers} layer{'s' if best.run_layers > 1 else ''} per saved input, {best.loss} loss"
        )
    return out
