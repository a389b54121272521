"""The longest sequence by GPU count: context parallelism over the GPUs of one host, estimated.

Why: past the longest sequence one GPU holds (checkpointing, offload and tiling all on), the next
question is how many GPUs a length needs. Under ``distributed.context_parallel: N`` each rank keeps
about ``1/N`` of a sequence's activations (its shard outside attention; the whole sequence for
``1/N`` of the heads inside it: the same bytes), while every rank holds the weights, and the ``N``
ranks of one host share its memory for offloaded layer inputs. Layer runs (one saved input per run
of k layers) count here as on one GPU; tiled layers do not (context parallelism refuses them). :func:`longest_by_gpus` runs the
long-context search (:func:`hone.transforms.long_context.longest_table`) for each count with the
host's memory divided by it, and ``hone plan`` prints the table (estimates, not measurements).
"""

from dataclasses import dataclass

from hone.config.root import HoneConfig
from hone.models.attention.ulysses import context_parallel_problems
from hone.transforms.long_context import LongestRow, best_row, longest_table
from hone.transforms.memory.facts import transformers_config
from hone.transforms.memory.knobs import LossKind
from hone.units import GIB

#: The GPU counts of one host the table shows.
GPU_COUNTS = (1, 2, 4, 8)


@dataclass(frozen=True)
class GpuCountRow:
    """The furthest any switch reaches on ``gpus`` GPUs splitting each sequence (``refused``: why
    the model cannot be split that way; ``best`` None: not even the shortest length fits)."""

    gpus: int
    best: LongestRow | None
    refused: str | None = None

    @property
    def longest(self) -> int:
        return self.best.longest if self.best is not None else 0


def rank_share(host_budget: int | None, source: str, split: int) -> tuple[int | None, str]:
    """(bytes, where they come from) of the host memory one rank of ``split`` on a host may use:
    the processes of a host (a context-parallel group, or every process of the job) share it,
    and the estimates are one rank's."""
    if split <= 1 or host_budget is None:
        return host_budget, source
    return host_budget // split, f"{source} / {split} ranks"


def shard_note(shard: int, split: int) -> str:
    """What the plan's model line adds under context parallelism: the tokens of one rank."""
    return f" (each rank {shard:,}: context parallel over {split})" if split > 1 else ""


def longest_by_gpus(
    cfg: HoneConfig,
    budget: int,
    host_budget: int | None,
    *,
    device: str = "cuda",
    losses: tuple[LossKind, ...] = ("standard", "fused_linear_ce"),
    fsdp: bool = False,
    counts: tuple[int, ...] = GPU_COUNTS,
) -> list[GpuCountRow] | None:
    """One row per GPU count: the longest sequence, per-rank GPU peak and host memory, with each
    sequence split over all of them (one GPU: no split); None where ``cfg`` does not ask for
    context parallelism (the plan shows no table). ``budget``: one GPU's bytes; ``host_budget``:
    the host's, shared by the ranks (None: unlimited); ``fsdp``: the weights sharded over the GPUs too."""
    if cfg.distributed.context_parallel <= 1:
        return None
    model_config = transformers_config(cfg.model)
    rows = []
    for n in counts:
        problems = context_parallel_problems(model_config, n) if n > 1 else []
        if problems:
            rows.append(GpuCountRow(n, None, problems[0]))
            continue
        host = host_budget // n if host_budget is not None else None
        table = longest_table(cfg, budget, host, device=device, losses=losses, param_shards=n if fsdp else 1, context_parallel=n)
        rows.append(GpuCountRow(n, best_row(table)))
    return rows


def render_by_gpus(rows: list[GpuCountRow], budget: int, host_budget: int | None) -> list[str]:
    """The lines ``hone plan`` prints under context parallelism."""
    host = f"{host_budget / GIB:.0f} GiB host shared by the ranks" if host_budget else "unlimited host memory"
    out = [
        f"Longest sequence by GPU count, each sequence split over the GPUs of one host (estimate; {budget / GIB:.0f} GiB "
        f"per GPU, {host}; per rank: GPU peak and host memory):"
    ]
    header = ["GPUs", "longest", "GPU peak", "host", "checkpointing", "tiled MLP", "tiled layers", "layer runs", "loss"]
    table = []
    for r in rows:
        if r.refused is not None:
            table.append([str(r.gpus), "refused", "-", "-", r.refused])
            continue
        best = r.best
        est = best.at_longest if best is not None else None
        table.append(
            [
                str(r.gpus),
                f"{r.longest:,}" if r.longest else "none",
                f"{est.total / GIB:.1f}" if est else "-",
                f"{est.host_total / GIB:.1f}" if est else "-",
                best.checkpointing if best else "-",
                ("auto" if best.tiled else "off") if best else "-",
                ("auto" if best.layers_tiled else "off") if best else "-",
                str(best.run_layers) if best else "-",
                best.loss if best else "-",
            ]
        )
    widths = [max(len(x[i]) for x in [header, *table] if i < len(x) and (i < 4 or x[1] != "refused")) for i in range(len(header))]

    def line(cells: list[str]) -> str:  # numbers right-aligned; a refusal's reason runs on
        head = [c.rjust(w) for c, w in zip(cells[:4], widths)]
        tail = cells[4:] if cells[1] == "refused" else [c.ljust(w) for c, w in zip(cells[4:], widths[4:])]
        return ("  " + "  ".join(head + tail)).rstrip()

    out += [line(header), *(line(x) for x in table)]
    return out
