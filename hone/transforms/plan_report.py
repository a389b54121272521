"""What ``hone plan`` prints: the optimizations a config asks for, the estimated memory by
component under every checkpointing policy against the card, and the longest sequence that fits.

Kept apart from the estimate (:mod:`hone.transforms.memory`, pure arithmetic) so the planner
can add its transform list (name, switch, on/off, why) to the same report through
:func:`render_plan` without touching the numbers.
"""

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hone.config.memory import POLICIES_BY_SPEED
from hone.config.root import HoneConfig
from hone.transforms.base import Decisions, RunFacts
from hone.transforms.card import DEFAULT_GPU_MEMORY, PlanInputError, device_memory, parse_size
from hone.transforms.context_plan import GpuCountRow, longest_by_gpus, rank_share, render_by_gpus, shard_note
from hone.transforms.decide import as_decided, decide
from hone.transforms.long_context import LongestRow, best_row, longest_table, render_longest
from hone.transforms.loss import loss_decision
from hone.transforms.memory.decide import AUTO_MARGIN, checkpointing_of, fits_within, loss_of, usable_bytes
from hone.transforms.memory.estimate import MemoryEstimate, estimate_memory
from hone.transforms.memory.facts import ModelFacts, model_facts
from hone.transforms.memory.knobs import Knobs, LossKind
from hone.transforms.memory.longest import longest_sequence
from hone.units import GIB, gib, gib_cell

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
    policy: str = ""
    """The checkpointing policy the run uses here (``auto`` resolved): the ``*`` column."""
    experts: str | None = None
    """How the experts are computed (``hone``, ``grouped_mm``, ...); None: a dense model."""
    sequence_len: int = 0
    remedies: tuple[str, ...] = ()
    """What would shrink the weights of this config, for a verdict that not even the shortest sequence fits."""
    by_gpus: list[GpuCountRow] | None = None
    """Context parallelism: the longest sequence on 1, 2, 4, 8 GPUs of one host (:mod:`hone.transforms.context_plan`)."""
    by_gpus_host: int | None = None
    """The host memory those GPUs share (``host_budget`` is one rank's share under context parallelism)."""


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
        ("fp8", _auto(decided.fp8, perf.fp8), "performance.fp8"),
        *(
            [("fp8 base linears", _auto(decided.fp8_base_linears, perf.fp8_base_linears), "performance.fp8_base_linears")]
            if decided.fp8_base_linears_why is not None
            else []
        ),
        ("sample packing", "on" if cfg.data.sample_packing else "off", "data.sample_packing"),
    ]
    if decided.tiled_layers_chunks >= 2 or decided.run_layers > 1:  # the long-context switches, where they are on
        at = next(i for i, row in enumerate(rows) if row[0] == "tiled MLP") + 1
        rows[at:at] = [
            ("tiled layers", _auto(f"{decided.tiled_layers_chunks} chunks", memory.tiled_layers), "memory.tiled_layers"),
            (
                "layer runs",
                _auto(f"{decided.run_layers} layers per saved input", memory.checkpoint_run_layers),
                "memory.checkpoint_run_layers",
            ),
        ]
    if model_facts(cfg).experts:
        rows.insert(
            1, ("experts", _auto(decided.experts_implementation, model.experts_implementation), "model.experts_implementation")
        )
        split = f"over {decided.expert_parallel} ranks" if decided.expert_parallel > 1 else "off"
        rows.insert(2, ("expert parallel", _auto(split, cfg.distributed.expert_parallel), "distributed.expert_parallel"))
    return rows


def _experts_format(facts: ModelFacts) -> str:
    """How the experts are stored, where not in model.dtype (MXFP4: a checkpoint as shipped, or model.quantize)."""
    from hone.models.experts.mxfp4 import MXFP4_BYTES_PER_WEIGHT
    from hone.models.loader import format_count

    if not facts.mxfp4_weights:
        return ""
    source = "as shipped" if facts.mxfp4_checkpoint else "model.quantize"
    return f", experts in MXFP4 ({source}; {format_count(facts.mxfp4_weights)} weights at {MXFP4_BYTES_PER_WEIGHT:g} B)"


def plan_view(
    cfg: HoneConfig,
    title: str,
    device: str,
    budget: int,
    budget_source: str,
    host_budget: int | None = None,
    host_source: str = "",
    decided: Decisions | None = None,
    processes: int = 1,
) -> PlanView:
    """Estimates under every policy, and the longest sequence each one fits in ``budget`` (and in
    ``host_budget`` bytes of host memory, default this machine's RAM). ``decided``: the plan's
    resolved ``auto`` settings (:func:`hone.transforms.decide.decide`), which the view quotes
    rather than deciding again; by default those of one process on ``device``. ``processes``:
    the job's processes, counted as on one host (they share its memory)."""
    from hone.transforms.auto_policy import auto_shards
    from hone.transforms.card import host_memory

    if host_budget is None:
        host_budget, host_source = host_memory(None)
    if decided is None:
        decided = decide(cfg, RunFacts(torch.device(device), memory_bytes=budget, host_memory_bytes=host_budget))
    written, cfg = cfg, as_decided(cfg, decided)  # estimates: per rank, experts, float8 linears, pair rows as decided
    param_shards = decided.param_shards
    loss = loss_of(cfg)
    whole_host, split = host_budget, cfg.distributed.context_parallel
    host_budget, host_source = rank_share(host_budget, host_source, max(split, processes))
    # the plan's tiled layers and layer runs (full and offload only: the estimate ignores them elsewhere)
    layers = {"tiled_layers": decided.tiled_layers_chunks, "run_layers": decided.run_layers}
    knobs = {
        p: Knobs(p, loss, device=device, host_budget=host_budget, param_shards=param_shards, **layers) for p in POLICIES_BY_SPEED
    }
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
    return PlanView(
        title=title,
        device=device,
        budget=budget,
        budget_source=budget_source,
        optimizations=resolved_optimizations(written, device, decided),
        chosen=checkpointing_of(cfg),
        loss=loss,
        estimates=estimates,
        longest=longest,
        model_line=_model_line(cfg, facts, estimates["none"], split),
        max_positions=facts.max_positions,
        tiled=tiled,
        tiled_longest=tiled_longest,
        tiled_line=tiled_line,
        tiled_on=decided.tiled_mlp_shards > 0,
        host_budget=host_budget,
        host_source=host_source,
        long_rows=long_rows,
        policy=decided.checkpointing,
        experts=decided.experts_implementation if facts.experts else None,
        sequence_len=cfg.data.sequence_len,
        remedies=_remedies(cfg),
        by_gpus=longest_by_gpus(cfg, budget, whole_host, device=device, losses=losses, fsdp=decided.strategy == "fsdp"),
        by_gpus_host=whole_host,
    )


def _model_line(cfg: HoneConfig, facts: ModelFacts, est: MemoryEstimate, split: int) -> str:
    """The plan's line about the model, its adapter and one rank's micro-batch."""
    from hone.models.loader import describe_adapter, format_count

    total = est.frozen_params + est.trainable_params
    accumulation = cfg.training.gradient_accumulation_steps
    return (
        f"{facts.architecture} ({cfg.model.source}), {format_count(total)} params, "
        f"{format_count(est.trainable_params)} trainable; "
        f"{describe_adapter(cfg.adapter)}; {cfg.model.dtype}{_experts_format(facts)}; "
        f"micro-batch {est.micro_batch} x {cfg.data.sequence_len} tokens{shard_note(est.sequence_len, split)}"
        + (f" x accumulation {accumulation}" if accumulation > 1 else "")
    )


def _remedies(cfg: HoneConfig) -> tuple[str, ...]:
    """What would shrink this config's weights (for a verdict that not even 256 tokens fit)."""
    ways = (
        ("a quantized base (model.quantize)", cfg.model.quantize == "none" and cfg.adapter.is_lora),
        ("LoRA (adapter.type: lora)", not cfg.adapter.is_lora),
        ("more processes (--nproc-per-node, FSDP)", True),
        ("a bigger device", True),
    )
    return tuple(what for what, applies in ways if applies)


#: Columns of ``hone plan``'s report unless ``--wide``: tables are cut, prose wrapped.
WIDTH = 100


def _table(header: list[str], rows: list[list[str]], numeric: bool = True) -> list[str]:
    """Columns padded to width: the first left-aligned, the rest right-aligned when they hold
    numbers (``numeric``), left-aligned when they hold words."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = (c.ljust(w) if i == 0 or not numeric else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return ("  " + "  ".join(padded)).rstrip()

    return [line(header), "  " + "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def _cut(lines: list[str], width: int | None) -> list[str]:
    """Table lines cut at ``width`` columns, the cut marked (``--wide``: ``width`` None, all of it)."""
    if width is None:
        return lines
    return [line if len(line) <= width else line[: width - 3] + "..." for line in lines]


def _wrap(text: str, width: int | None, indent: str = "  ") -> list[str]:
    """Prose wrapped at ``width`` columns, continuation lines indented two more."""
    if width is None:
        return [indent + text]
    return textwrap.wrap(
        text, width, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False, break_long_words=False
    )


def _wrap_parts(text: str, width: int | None, indent: str = "  ") -> list[str]:
    """``a; b; c`` wrapped between its ``; ``-separated parts (a part longer than a line by words)."""
    if width is None:
        return [indent + text]
    lines: list[str] = []
    for part in text.split("; "):
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += "; " + part
        else:
            if lines:
                lines[-1] += ";"
            lines += _wrap(part, width, indent if not lines else indent + "  ")
    return lines


def memory_word(device: str) -> str:
    """What the budget is on ``device``: a GPU's memory, or (``cpu``) the machine's."""
    return "GPU" if device.startswith("cuda") else "memory"


def _fits_row(label: str, estimates: dict[str, MemoryEstimate], budget: int, host_budget: int | None) -> list[str]:
    """Whether each policy's estimate fits (:func:`fits_within`, as everywhere), and its share of the card."""
    return [
        label,
        *(
            ("yes" if fits_within(e, budget, host_budget) else "NO") + f" ({100 * e.total / budget:.0f}%)"
            for e in estimates.values()
        ),
    ]


def _effective(view: PlanView) -> tuple[dict[str, MemoryEstimate], dict[str, int]]:
    """The estimates and longest sequences of the run as it runs here (the MLP tiled when it is)."""
    if view.tiled_on and view.tiled and view.tiled_longest:
        return view.tiled, view.tiled_longest
    return view.estimates, view.longest


def verdict(view: PlanView) -> tuple[str, str | None]:
    """The report's first line (fits or not, by how much, on what, and how long a sequence fits)
    and, when it does not fit, a second one: what to change."""
    estimates, longest = _effective(view)
    policy = view.policy if view.policy in estimates else view.chosen
    est = estimates[policy]
    budget, host = view.budget, view.host_budget
    share = f"{est.total / GIB:.1f} of {budget / GIB:.1f} GiB ({100 * est.total / budget:.0f}%)"
    run = f"on {view.device}, checkpointing {policy}"
    if fits_within(est, budget, host):
        return f"fits: {share} {run}; longest that fits: {max(longest[policy], view.sequence_len):,}", None
    if est.total <= usable_bytes(budget) and host is not None:
        why = f"host needs {est.host_total / GIB:.1f} of {host / GIB:.1f} GiB"
    else:
        why = f"over {100 - 100 * AUTO_MARGIN:.0f}%"
    fitting = [p for p in estimates if fits_within(estimates[p], budget, host)]
    if fitting and view.chosen != "auto":
        change = f"set memory.activation_checkpointing: {fitting[0]} (fits)"
    elif max(longest.values()) > 0:
        change = f"shorten data.sequence_len to {max(longest.values()):,} or less, or lower training.micro_batch_size"
    else:
        weights = dict(est.components()).get("weights", 0)
        ways = ", ".join(view.remedies[:-1]) + f" or {view.remedies[-1]}" if view.remedies else "a bigger device"
        change = f"not even 256 tokens fit (the weights alone: {weights / GIB:.1f} GiB): {ways}"
    return f"does not fit: {share} {run} ({why})", f"  what to change: {change}"


def _state(name: str, on: bool, view: PlanView) -> str:
    """A transform's on/off; the experts by their implementation (transformers' ``grouped_mm`` is not "off")."""
    if name == "experts" and view.experts is not None:
        return view.experts
    return "on" if on else "off"


def _longest_cell(view: PlanView, est: MemoryEstimate, longest: int) -> str:
    """The longest sequence that fits, never shorter than the configured one when that fits (the
    search steps in multiples of 256 tokens)."""
    if fits_within(est, view.budget, view.host_budget):
        longest = max(longest, view.sequence_len)
    return f"{longest:,}" if longest else "none"


def _memory_rows(view: PlanView, policies: list[str], wide: bool) -> list[list[str]]:
    any_est = next(iter(view.estimates.values()))
    peak = f"peak ({memory_word(view.device)})"

    def phase(p: str) -> str:  # "backward, last layer" -> "bwd last layer": four columns in 100
        return view.estimates[p].phase if wide else view.estimates[p].phase.replace("backward, ", "bwd ")

    rows = []
    for index, (label, _) in enumerate(any_est.components()):
        rows.append([label, *(gib_cell(view.estimates[p].components()[index][1]) for p in policies)])
    rows.append([peak, *(gib_cell(view.estimates[p].total) for p in policies)])
    rows.append(["  at", *(phase(p) for p in policies)])
    rows.append(["host (pinned)", *(gib_cell(view.estimates[p].host) for p in policies)])
    rows.append(["host (process, pinned incl.)", *(gib_cell(view.estimates[p].host_total) for p in policies)])
    if "offload" in view.estimates:
        off = view.estimates["offload"]
        runs = f"/{-(-off.layers // off.run_layers)} runs" if off.run_layers > 1 else f"/{off.layers}"
        rows.append(["layers offloaded", *(f"{off.offloaded_layers}{runs}" if p == "offload" else "-" for p in policies)])
    rows.append(["activations per layer", *(gib_cell(view.estimates[p].activations_per_layer) for p in policies)])
    budget, host = view.budget, view.host_budget
    fits_label = f"fits {gib(budget)} less {AUTO_MARGIN:.0%}"
    rows.append(_fits_row(fits_label, view.estimates, budget, host))
    rows.append(["longest sequence that fits", *(_longest_cell(view, view.estimates[p], view.longest[p]) for p in policies)])
    if view.tiled:
        shards = next(iter(view.tiled.values())).tiled_mlp
        label = f"tiled MLP ({shards} shards): activations" if wide else f"tiled MLP x{shards}: activations"
        rows.append([label, *(gib_cell(view.tiled[p].activations) for p in policies)])
        rows.append([f"  {peak}", *(gib_cell(view.tiled[p].total) for p in policies)])
        rows.append(_fits_row(f"  {fits_label}", view.tiled, budget, host))
    if view.tiled_longest:
        longest_tiled = (_longest_cell(view, view.tiled[p], view.tiled_longest[p]) if view.tiled else "" for p in policies)
        rows.append(["  longest sequence that fits", *longest_tiled])
    return rows


def render_plan(view: PlanView, transforms: Sequence[TransformLine] | None = None, wide: bool = False) -> str:
    """The report: a verdict line, then the model, the optimizations, the planner's transforms
    (``transforms``: name, switch, on, why), the memory by component under each checkpointing
    policy and the longest sequence. At most :data:`WIDTH` columns unless ``wide``."""
    width = None if wide else WIDTH
    first, change = verdict(view)
    out = [first, *([] if change is None else _wrap(change.strip(), width)), f"hone plan: {view.title}"]
    out += [*_wrap_parts(view.model_line, width), ""]
    out.append("Optimizations this run uses (auto: decided here from the model and the device):")
    chosen = [[what, value, key] for what, value, key in view.optimizations]
    out += _cut(_table(["", "value", "key"], chosen, numeric=False), width)
    if transforms:
        out += ["", "Transforms, in the order the planner applies them" + (":" if wide else " (--wide: their reasons in full):")]
        if wide:
            lines = [[name, _state(name, on, view), switch, why] for name, switch, on, why in transforms]
            out += _table(["", "", "switch", "why"], lines, numeric=False)
        else:  # the why names the switch; it gets the room
            lines = [[name, _state(name, on, view), why] for name, _, on, why in transforms]
            out += _cut(_table(["", "", "why"], lines, numeric=False), width)
    policies = list(view.estimates)
    marked_policy = view.policy if view.chosen == "auto" else view.chosen
    marked = [p + (" *" if p == marked_policy else "") for p in policies]
    any_est = next(iter(view.estimates.values()))
    star = "the checkpointing auto chose" if view.chosen == "auto" else "this config's checkpointing"
    out += [""] + _wrap(
        f"Memory by component, GiB (estimate: no weights loaded; {view.loss} loss"
        f"{', compiled layers' if any_est.compiled else ''}; * = {star}):",
        width,
        indent="",
    )
    out += _cut(_table(["component", *marked], _memory_rows(view, policies, wide)), width)
    budget = view.budget
    notes = []
    if view.tiled_line and (wide or view.tiled_on):
        notes.append(f"tiled MLP: {view.tiled_line}")
    device_memory_name = "card" if view.device.startswith("cuda") else "memory"
    notes.append(
        f"{device_memory_name}: {gib(budget)} ({view.budget_source}), device {view.device}; fits = within "
        f"{gib(usable_bytes(budget))} (a {AUTO_MARGIN:.0%} margin)"
    )
    longest = max(view.longest.values())
    if view.max_positions and longest > view.max_positions:
        notes.append(f"note: the model's max_position_embeddings is {view.max_positions:,}; longer sequences need RoPE scaling")
    effective, _ = _effective(view)
    fitting = [p for p in policies if fits_within(effective[p], budget, view.host_budget)]
    if view.chosen == "auto":
        fits = ", ".join(fitting) if fitting else "no policy"
        notes.append(f"checkpointing auto: fits under {fits}; it picks the fastest that fits")
    elif view.chosen in effective and view.chosen not in fitting:
        hint = (
            f"; fits with: {', '.join(fitting)}"
            if fitting
            else "; no policy fits: shorten data.sequence_len or training.micro_batch_size"
        )
        notes.append(f"warning: checkpointing '{view.chosen}' does not fit this {device_memory_name}{hint}")
    notes += [f"note: {n}" for n in sorted({n for e in view.estimates.values() for n in e.notes})]
    for note in notes:
        out += _wrap(note, width)
    if view.long_rows:
        memory = memory_word(view.device)
        if wide:
            out += ["", *render_longest(view.long_rows, budget, view.host_budget, view.host_source, memory=memory)]
        elif (best := best_row(view.long_rows)) is not None:
            out += [""] + _wrap(
                f"Longest sequence with any switch: {best.longest:,} tokens (checkpointing {best.checkpointing}, "
                f"tiled MLP {'auto' if best.tiled else 'off'}, tiled layers {'auto' if best.layers_tiled else 'off'}, "
                f"checkpoint_run_layers {best.run_layers}, "
                f"{best.loss} loss); --wide: every combination",
                width,
                indent="",
            )
    if view.by_gpus:
        title, *table = render_by_gpus(view.by_gpus, budget, view.by_gpus_host)
        out += ["", *_wrap(title, width, indent=""), *_cut(table, width)]
    return "\n".join(out) + "\n"
