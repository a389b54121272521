"""What ``hone plan`` prints: the optimizations a config asks for, the estimated memory by
component under every checkpointing policy against the card, and the longest sequence that fits.

Kept apart from the estimate (:mod:`hone.transforms.memory`, pure arithmetic) so the planner
can add its transform list (name, switch, on/off, why) to the same report through
:func:`render_plan` without touching the numbers.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hone.config.memory import POLICIES_BY_SPEED
from hone.config.root import HoneConfig
from hone.transforms.base import Decisions, RunFacts
from hone.transforms.card import DEFAULT_GPU_MEMORY, PlanInputError, device_memory, parse_size
from hone.transforms.decide import decide
from hone.transforms.long_context import LongestRow, longest_table, render_longest
from hone.transforms.loss import loss_decision
from hone.transforms.memory.decide import checkpointing_of, loss_of
from hone.transforms.memory.estimate import MemoryEstimate, estimate_memory
from hone.transforms.memory.facts import model_facts
from hone.transforms.memory.knobs import Knobs, LossKind
from hone.transforms.memory.longest import longest_sequence
from hone.units import gib, gib_cell

__all__ = ["DEFAULT_GPU_MEMORY", "PlanInputError", "PlanView", "device_memory", "parse_size", "plan_view", "render_plan"]

TransformLine = tuple[str, str, bool, str]
"""(name, switch, on, why): one line of the planner's transform list."""


@dataclass(frozen=True)
class PlanView:
    """Everything the report shows, computed once."""

    title: str
    device: str
    budget: int
    budget_source: str
    optimizations: list[tuple[str, str, str]]
    """(what, value, from which key) as the config resolves it."""
    chosen: str
    """The config's checkpointing policy (none/full/selective/offload/auto)."""
    loss: LossKind
    estimates: dict[str, MemoryEstimate]
    longest: dict[str, int]
    model_line: str
    max_positions: int | None
    tiled: dict[str, MemoryEstimate] | None = None
    """The same estimates with the MLP tiled (``memory.tiled_mlp``'s count, or ``auto``'s)."""
    tiled_longest: dict[str, int] | None = None
    tiled_line: str = ""
    """The tiling the config runs with here, and why."""
    tiled_on: bool = False
    """The config runs with the MLP tiled here (configured, or ``auto`` decided so)."""
    host_budget: int | None = None
    host_source: str = ""
    long_rows: list[LongestRow] | None = None
    """The longest sequence of every policy x tiling x loss (:mod:`hone.transforms.long_context`)."""


def _auto(value: str, asked: object) -> str:
    """A decided value, marked where ``auto`` chose it."""
    return f"{value} (auto)" if asked == "auto" else value


def resolved_optimizations(cfg: HoneConfig, device: str, decided: Decisions) -> list[tuple[str, str, str]]:
    """What the config asks for, resolved for ``device`` by the plan's ``decided`` settings (the
    planner's transform list, with reasons, comes later through ``render_plan(transforms=...)``)."""
    perf, model, memory = cfg.performance, cfg.model, cfg.memory
    compile_value = _auto(f"on ({perf.torch_compile_scope})" if decided.compile else "off", perf.torch_compile)
    graphs = _auto("on" if decided.cuda_graphs else "off", "auto" if perf.cudagraphs_setting is None else None)
    policy = decided.checkpointing
    if decided.compiler_memory_budget is not None:
        policy += f", Inductor memory budget {decided.compiler_memory_budget}"
    attention = model.attn_implementation
    if cfg.data.sample_packing and attention == "sdpa":
        attention += f" (packed rows: sdpa_varlen {model.sdpa_varlen})"
    rows = [
        ("attention", attention, "model.attn_implementation"),
        ("checkpointing", _auto(policy, memory.checkpointing), "memory.activation_checkpointing"),
        ("compile", compile_value, "performance.torch_compile"),
        ("CUDA graphs", graphs, "performance.cuda_graphs"),
        (
            "tiled MLP",
            _auto(f"{decided.tiled_mlp_shards} shards" if decided.tiled_mlp_shards else "off", memory.tiled_mlp),
            "memory.tiled_mlp",
        ),
        ("loss", loss_of(cfg), "performance.loss"),
        ("fp8", perf.fp8, "performance.fp8"),
        ("sample packing", "on" if cfg.data.sample_packing else "off", "data.sample_packing"),
    ]
    if model_facts(cfg).experts:
        rows.insert(
            1, ("experts", _auto(decided.experts_implementation, model.experts_implementation), "model.experts_implementation")
        )
    return rows


def plan_view(
    cfg: HoneConfig,
    title: str,
    device: str,
    budget: int,
    budget_source: str,
    host_budget: int | None = None,
    host_source: str = "",
    decided: Decisions | None = None,
) -> PlanView:
    """Estimates under every policy, and the longest sequence each one fits in ``budget`` (and in
    ``host_budget`` bytes of host memory, default this machine's RAM). ``decided``: the plan's
    resolved ``auto`` settings (:func:`hone.transforms.decide.decide`), which the view quotes
    rather than deciding again; by default those of one process on ``device``."""
    from hone.models.loader import describe_adapter, format_count
    from hone.transforms.auto_policy import auto_shards
    from hone.transforms.card import host_memory

    if host_budget is None:
        host_budget, host_source = host_memory(None)
    if decided is None:
        decided = decide(cfg, RunFacts(torch.device(device), memory_bytes=budget, host_memory_bytes=host_budget))
    param_shards = decided.param_shards
    loss = loss_of(cfg)
    knobs = {p: Knobs(p, loss, device=device, host_budget=host_budget, param_shards=param_shards) for p in POLICIES_BY_SPEED}
    estimates = {p: estimate_memory(cfg, knobs[p]) for p in POLICIES_BY_SPEED}
    longest = {p: longest_sequence(cfg, knobs[p], budget) for p in POLICIES_BY_SPEED}
    # tiled: the configured count, else auto's (also for "off": what tiling would give)
    configured = cfg.memory.tiled_mlp_shards
    shards = configured if configured else auto_shards(cfg)
    per_length: int | str = configured if configured else "auto"
    tiled = {p: estimate_memory(cfg, replace(knobs[p], tiled_mlp=shards)) for p in POLICIES_BY_SPEED}
    tiled_longest = {p: longest_sequence(cfg, replace(knobs[p], tiled_mlp=per_length), budget) for p in POLICIES_BY_SPEED}
    # the fused loss is a column only where it can compute this model's loss exactly
    loss_auto = cfg.model_copy(update={"performance": cfg.performance.model_copy(update={"loss": "auto"})})
    fusable = loss == "fused_linear_ce" or loss_decision(loss_auto)[0] == "fused_linear_ce"
    losses: tuple[LossKind, ...] = ("standard", "fused_linear_ce") if fusable else ("standard",)
    long_rows = longest_table(cfg, budget, host_budget, device=device, losses=losses, param_shards=param_shards)
    tiled_line = (f"on, {decided.tiled_mlp_shards} shards" if decided.tiled_mlp_shards else "off") + f": {decided.tiled_mlp_why}"
    if cfg.memory.checkpointing == "auto":
        tiled_line += f"; checkpointing {decided.checkpointing} ({decided.checkpointing_why})"
    facts = model_facts(cfg)
    est = estimates["none"]
    total = est.frozen_params + est.trainable_params
    model_line = (
        f"{facts.architecture} ({cfg.model.source}), {format_count(total)} params, "
        f"{format_count(est.trainable_params)} trainable; "
        f"{describe_adapter(cfg.adapter)}; {cfg.model.dtype}; micro-batch {est.micro_batch} x {est.sequence_len} tokens"
        + (f" x accumulation {cfg.training.gradient_accumulation_steps}" if cfg.training.gradient_accumulation_steps > 1 else "")
    )
    return PlanView(
        title=title,
        device=device,
        budget=budget,
        budget_source=budget_source,
        optimizations=resolved_optimizations(cfg, device, decided),
        chosen=checkpointing_of(cfg),
        loss=loss,
        estimates=estimates,
        longest=longest,
        model_line=model_line,
        max_positions=facts.max_positions,
        tiled=tiled,
        tiled_longest=tiled_longest,
        tiled_line=tiled_line,
        tiled_on=decided.tiled_mlp_shards > 0,
        host_budget=host_budget,
        host_source=host_source,
        long_rows=long_rows,
    )


def _table(header: list[str], rows: list[list[str]], numeric: bool = True) -> list[str]:
    """Columns padded to width: the first left-aligned, the rest right-aligned when they hold
    numbers (``numeric``), left-aligned when they hold words."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = (c.ljust(w) if i == 0 or not numeric else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return ("  " + "  ".join(padded)).rstrip()

    return [line(header), "  " + "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def _fits_row(label: str, estimates: dict[str, MemoryEstimate], budget: int) -> list[str]:
    """Whether each policy's estimate fits the card, and its share of it."""
    return [label, *(("yes" if e.total <= budget else "NO") + f" ({100 * e.total / budget:.0f}%)" for e in estimates.values())]


def render_plan(view: PlanView, transforms: Sequence[TransformLine] | None = None) -> str:
    """The report. ``transforms``: the planner's lines (name, switch, on, why), shown in order."""
    out = [f"hone plan: {view.title}", f"  {view.model_line}", ""]
    out.append("Optimizations this run uses (auto: decided here from the model and the device):")
    out += _table(["", "value", "key"], [[what, value, key] for what, value, key in view.optimizations], numeric=False)
    if transforms:
        out += ["", "Transforms, in the order the planner applies them:"]
        lines = [[name, "on" if on else "off", switch, why] for name, switch, on, why in transforms]
        out += _table(["", "", "switch", "why"], lines, numeric=False)
    policies = list(view.estimates)
    marked = [p + (" *" if p == view.chosen else "") for p in policies]
    any_est = next(iter(view.estimates.values()))
    out += [
        "",
        f"Memory by component, GiB (estimate: no weights loaded; {view.loss} loss"
        f"{', compiled layers' if any_est.compiled else ''}; * = this config's checkpointing):",
    ]
    rows = []
    for index, (label, _) in enumerate(any_est.components()):
        rows.append([label, *(gib_cell(view.estimates[p].components()[index][1]) for p in policies)])
    rows.append(["peak (GPU)", *(gib_cell(view.estimates[p].total) for p in policies)])
    rows.append(["  at", *(view.estimates[p].phase for p in policies)])
    rows.append(["host (pinned)", *(gib_cell(view.estimates[p].host) for p in policies)])
    rows.append(["host (process, pinned incl.)", *(gib_cell(view.estimates[p].host_total) for p in policies)])
    if "offload" in view.estimates:
        off = view.estimates["offload"]
        rows.append(["layers offloaded", *(f"{off.offloaded_layers}/{off.layers}" if p == "offload" else "-" for p in policies)])
    rows.append(["activations per layer", *(gib_cell(view.estimates[p].activations_per_layer) for p in policies)])
    budget = view.budget
    rows.append(_fits_row(f"fits {gib(budget)}", view.estimates, budget))
    rows.append(["longest sequence that fits", *(f"{view.longest[p]:,}" if view.longest[p] else "none" for p in policies)])
    if view.tiled:
        shards = next(iter(view.tiled.values())).tiled_mlp
        rows.append([f"tiled MLP ({shards} shards): activations", *(gib_cell(view.tiled[p].activations) for p in policies)])
        rows.append(["  peak (GPU)", *(gib_cell(view.tiled[p].total) for p in policies)])
        rows.append(_fits_row(f"  fits {gib(budget)}", view.tiled, budget))
    if view.tiled_longest:
        longest_tiled = (f"{view.tiled_longest[p]:,}" if view.tiled_longest[p] else "none" for p in policies)
        rows.append(["  longest sequence that fits", *longest_tiled])
    out += _table(["component", *marked], rows)
    if view.tiled_line:
        out.append(f"  tiled MLP: {view.tiled_line}")
    out.append(f"  card: {gib(budget)} ({view.budget_source}); device {view.device}")
    longest = max(view.longest.values())
    if view.max_positions and longest > view.max_positions:
        out.append(f"  note: the model's max_position_embeddings is {view.max_positions:,}; longer sequences need RoPE scaling")
    # what the run really uses: the tiled estimates when it tiles the MLP
    effective = view.tiled if view.tiled_on and view.tiled else view.estimates
    if view.chosen == "auto":
        fitting = [p for p in policies if effective[p].total <= budget]
        fits = ", ".join(fitting) if fitting else "no policy"
        out.append(f"  checkpointing auto: fits under {fits} (the planner picks the fastest with a margin)")
    elif view.chosen in effective and effective[view.chosen].total > budget:
        fitting = [p for p in policies if effective[p].total <= budget]
        hint = (
            f"; fits with: {', '.join(fitting)}"
            if fitting
            else "; no policy fits: shorten data.sequence_len or training.micro_batch_size"
        )
        out.append(f"  warning: checkpointing '{view.chosen}' does not fit this card{hint}")
    notes = sorted({n for e in view.estimates.values() for n in e.notes})
    out += [f"  note: {n}" for n in notes]
    if view.long_rows:
        out += ["", *render_longest(view.long_rows, budget, view.host_budget, view.host_source)]
    return "\n".join(out) + "\n"
