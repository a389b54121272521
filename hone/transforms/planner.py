"""The optimization planner: which transforms a run applies, in which order, and the record.

Each optimization is a :class:`Transform`: a name, the config key that switches it on, what it
needs from the run (checked before the model is loaded) and an ``apply`` step that changes the
loaded model in place and returns what it did. Combinations the config alone can rule out are
refused earlier, by the config's validators (``hone validate`` catches them); the checks here
are the ones that need the run: the device and the shapes of the prepared data.

The order is fixed and is the order of :data:`TRANSFORMS` (torchtitan's ``parallelize`` is the
model: one list, read top to bottom):

1. ``compile`` -- ``torch.compile`` of each decoder layer or of the whole model. Compilation
   traces whatever modules it finds, so transforms that swap modules or kernels (fused LoRA,
   fused loss, tiled MLP, ...) go *before* it; activation checkpointing is switched on by the
   loader and composes with it (see :mod:`hone.transforms.compile`). Sharding (FSDP2) would come after.

The applied list is printed and written to ``optimizations.json`` in the run directory,
together with what was skipped and why, and the compile counts once training ends.
"""

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hone.config.root import HoneConfig
from hone.errors import HoneError
from hone.transforms import compile as compile_transform
from hone.transforms.inductor import configure_cache_dir

OPTIMIZATIONS_FILE = "optimizations.json"


class PlanError(HoneError):
    """The run cannot apply an optimization its config asks for."""


@dataclass(frozen=True)
class RunFacts:
    """What the planner needs to know about the run beyond its config."""

    device: torch.device
    shape_note: str | None = None
    """None when every training micro-batch has one shape and layout; otherwise why not
    (packing: fixed width but document boundaries that move; rows of different lengths)."""
    lengths_vary: bool = False
    """Micro-batches are padded to different widths (unpacked rows of different lengths)."""


@dataclass(frozen=True)
class Transform:
    name: str
    switch: str
    """The config key that turns it on."""
    wanted: Callable[[HoneConfig, RunFacts], bool]
    """Whether the config asks for it on this run (e.g. ``torch_compile: auto`` on CUDA)."""
    check: Callable[[HoneConfig, RunFacts], list[str]]
    """Requirements on the run; each problem is one message naming the key and the fix."""
    apply: Callable[[nn.Module, HoneConfig, RunFacts], dict[str, Any]]
    conflicts: tuple[str, ...] = ()
    """Transforms it cannot be combined with (also refused at validation time)."""
    skipped_because: Callable[[HoneConfig, RunFacts], str | None] = lambda cfg, facts: None
    """Why a transform the config mentions is not applied on this run, for the record."""


@dataclass
class Applied:
    name: str
    switch: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    transforms: list[Transform]
    skipped: list[dict[str, str]]

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.transforms]


# ---------------------------------------------------------------- 1. torch.compile


def _compile_wanted(cfg: HoneConfig, facts: RunFacts) -> bool:
    return cfg.performance.compiles_on(facts.device.type)


def _compile_check(cfg: HoneConfig, facts: RunFacts) -> list[str]:
    perf = cfg.performance
    problems = []
    if perf.uses_cudagraphs and facts.device.type != "cuda":
        problems.append(f"{perf.cudagraphs_source} uses CUDA graphs, which need a CUDA device (training on {facts.device.type})")
    if perf.uses_cudagraphs and facts.shape_note is not None:
        problems.append(
            f"{perf.cudagraphs_source} uses CUDA graphs, which need one fixed shape, but {facts.shape_note}: every "
            "new shape would record another graph and hold its memory. Use triton.cudagraphs: false (or "
            "torch_compile_mode: max-autotune-no-cudagraphs), or train on rows of one length"
        )
    return problems


def _compile_apply(model: nn.Module, cfg: HoneConfig, facts: RunFacts) -> dict[str, Any]:
    cache_dir, chosen_by_hone = configure_cache_dir()
    perf = cfg.performance
    dynamic = facts.lengths_vary
    if perf.torch_compile_scope == "regional":
        details = compile_transform.compile_regional(model, perf, dynamic)
    else:
        details = compile_transform.compile_model(model, perf, dynamic)
    details["mode"] = perf.torch_compile_mode or "default"
    details["user_options"] = dict(perf.torch_compile_options)
    details["cache_dir"] = str(cache_dir)
    details["cache_dir_from"] = "hone default" if chosen_by_hone else "TORCHINDUCTOR_CACHE_DIR"
    return details


def _compile_skipped(cfg: HoneConfig, facts: RunFacts) -> str | None:
    if cfg.performance.torch_compile == "auto" and facts.device.type != "cuda":
        return f"torch_compile: auto compiles on CUDA only; this run trains on {facts.device.type}"
    return None


COMPILE = Transform(
    name="compile",
    switch="performance.torch_compile",
    wanted=_compile_wanted,
    check=_compile_check,
    apply=_compile_apply,
    skipped_because=_compile_skipped,
)

#: Every transform, in the order they are applied (see the module docstring for why).
TRANSFORMS: tuple[Transform, ...] = (COMPILE,)


# ---------------------------------------------------------------- planning and applying


def plan_optimizations(cfg: HoneConfig, facts: RunFacts, transforms: tuple[Transform, ...] = TRANSFORMS) -> Plan:
    """The transforms this run applies, in order; raises :class:`PlanError` with every problem."""
    chosen, skipped, problems = [], [], []
    for transform in transforms:
        if not transform.wanted(cfg, facts):
            reason = transform.skipped_because(cfg, facts)
            if reason:
                skipped.append({"name": transform.name, "switch": transform.switch, "reason": reason})
            continue
        problems += transform.check(cfg, facts)
        chosen.append(transform)
    names = {t.name for t in chosen}
    for transform in chosen:
        clash = sorted(names & set(transform.conflicts))
        if clash:
            problems.append(f"{transform.switch} ({transform.name}) cannot be combined with {', '.join(clash)}")
    if problems:
        raise PlanError("cannot apply the optimizations the config asks for:\n  - " + "\n  - ".join(problems))
    return Plan(chosen, skipped)


def apply_optimizations(model: nn.Module, plan: Plan, cfg: HoneConfig, facts: RunFacts) -> list[Applied]:
    """Apply ``plan`` to ``model`` in place, in order; returns the record of what was done."""
    return [Applied(t.name, t.switch, t.apply(model, cfg, facts)) for t in plan.transforms]


def describe(applied: list[Applied], plan: Plan) -> str:
    """One console line: what was applied (and what the config mentions but this run skips)."""
    if not applied and not plan.skipped:
        return "optimizations: none"
    parts = []
    for item in applied:
        d = item.details
        if item.name == "compile":
            extra = f"{d['scope']}"
            if d.get("layers"):
                extra += f", {d['layers']} layers"
            extra += f", {d['backend']}"
            if d.get("mode") not in (None, "default"):
                extra += f", mode {d['mode']}"
            if d.get("user_options"):
                extra += ", " + ", ".join(f"{k}={v}" for k, v in d["user_options"].items())
            parts.append(f"compile ({extra})")
        else:
            parts.append(item.name)
    text = "optimizations: " + (", ".join(parts) if parts else "none")
    for skip in plan.skipped:
        text += f"; skipped {skip['name']}: {skip['reason']}"
    return text


def write_record(out_dir: Path, applied: list[Applied], plan: Plan, compile_stats: dict[str, Any] | None = None) -> Path:
    """``optimizations.json``: applied transforms in order, skipped ones, compile counts."""
    from hone.atomic import atomic_write_text

    record: dict[str, Any] = {
        "applied": [asdict(a) for a in applied],
        "skipped": plan.skipped,
        "torch": torch.__version__,
    }
    if compile_stats is not None:
        record["compile"] = compile_stats
    path = Path(out_dir) / OPTIMIZATIONS_FILE
    atomic_write_text(path, json.dumps(record, indent=2, default=str) + "\n")
    return path
