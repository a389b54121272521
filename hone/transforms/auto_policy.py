"""The ``auto`` memory settings, decided from the memory estimate: the checkpointing policy
(``memory.activation_checkpointing: auto``) and the tiled MLP (``memory.tiled_mlp: auto``).

The rule, in words (``hone plan`` prints the outcome and why):

1. A run that fits untiled is not tiled: tiling costs one extra MLP forward per layer.
2. ``activation_checkpointing: auto`` picks the fastest policy whose estimated peak fits the
   card with a margin, untiled first; when none fits untiled and ``tiled_mlp`` is ``auto``, the
   fastest policy that fits with the MLP tiled (that combination is then the plan). An explicit
   shard count is estimated tiled from the start. Some runs narrow the choice
   (:func:`_auto_policies`): explicit tiled layers need ``full`` or ``offload``; a quantized base
   never keeps every activation, and its ``selective`` keeps the least the compiler may.
3. ``tiled_mlp: auto`` under the policy in force (configured, or picked by 2.) turns tiling on
   when the untiled estimate does not fit and the tiled one does: the MLP's ``[tokens x
   intermediate]`` activations are then what does not fit. When neither fits, tiling stays off
   (it would not make the run fit; the plan says what does not fit).
"""

from dataclasses import dataclass, replace
from typing import Any

from hone.config.memory import (
    INPUT_ONLY_POLICIES,
    POLICIES_BY_SPEED,
    SELECTIVE_BUDGET_STEP,
    choose_auto_policy,
    selective_budget_floor,
)
from hone.config.root import HoneConfig
from hone.transforms.card import device_memory, host_memory
from hone.transforms.memory.decide import AUTO_MARGIN as MARGIN
from hone.transforms.memory.decide import TiledDecision, auto_limit, decide_tiled_layers, decide_tiled_mlp, loss_of
from hone.transforms.memory.estimate import estimate_memory
from hone.transforms.memory.facts import model_facts
from hone.transforms.memory.knobs import Knobs
from hone.transforms.memory.terms.offload import HOST_MARGIN, host_process_bytes, offload_split, pinned_block
from hone.transforms.memory.terms.tiled_mlp import auto_tiled_shards
from hone.units import GIB, gib


@dataclass(frozen=True)
class MemoryChoice:
    """The policy and the tiling a config runs with on a device, and why."""

    policy: str
    policy_why: str
    shards: int
    """Shards of the tiled MLP; 0: untiled."""
    tiled_why: str
    does_not_fit: bool = False
    """``tiled_mlp: auto`` left tiling off on a run that does not fit (worth recording)."""


def _budget(device: Any, budget: int | None) -> tuple[str, int, str]:
    kind = getattr(device, "type", str(device))
    if budget is None:
        budget, source = device_memory(kind, None)
    else:
        source = f"a {gib(budget)} card"
    return kind, budget, source


def auto_shards(cfg: HoneConfig, sequence_len: int | None = None) -> int:
    """The shard count ``tiled_mlp: auto`` uses for ``cfg`` (about ``hidden_size`` tokens each)."""
    tokens = cfg.micro_batch_tokens_per_rank(sequence_len)
    return auto_tiled_shards(tokens, model_facts(cfg).hidden)


def decide_memory(
    cfg: HoneConfig, device: Any, budget: int | None = None, *, host_budget: int | None = None, param_shards: int = 1
) -> MemoryChoice:
    """The checkpointing policy and MLP tiling of ``cfg`` on ``device`` (``budget``: the memory
    to plan for, default the device's; ``host_budget``: the host memory for an ``offload`` split,
    default this machine's RAM; ``param_shards``: processes FSDP shards the weights over),
    ``auto`` settings decided by the rule of the module doc. A plan decides it once
    (:func:`plan_memory`, through :func:`hone.transforms.decide.decide`)."""
    kind, budget, source = _budget(device, budget)
    if host_budget is None:
        host_budget = host_memory(None)[0]
    usable, _ = auto_limit(budget, source)
    configured = cfg.memory.tiled_mlp_shards  # None: auto
    policy = cfg.memory.checkpointing
    loss = loss_of(cfg)
    if param_shards > 1:
        source = f"{source}, weights sharded over {param_shards} processes"

    def peak(p: str, shards: int) -> int:
        est = estimate_memory(
            cfg, Knobs(p, loss, device=kind, tiled_mlp=shards, host_budget=host_budget, param_shards=param_shards)
        )
        return est.total

    fixed_shards = configured if configured is not None else 0
    if policy == "auto":
        policies = [p for p in POLICIES_BY_SPEED if kind == "cuda" or p != "offload"]
        allowed, because = _auto_policies(cfg)
        policies = [p for p in policies if p in allowed]
        estimates = {p: peak(p, fixed_shards) for p in policies}
        policy, why = choose_auto_policy(estimates, budget, MARGIN)
        policy_why = f"activation_checkpointing: auto on {source}{because}: {why}"
        if configured is None and estimates[policy] > usable:
            shards = auto_shards(cfg)
            tiled = {p: peak(p, shards) for p in policies}
            if any(t <= usable for t in tiled.values()):
                policy, why = choose_auto_policy(tiled, budget, MARGIN)
                policy_why = (
                    f"activation_checkpointing: auto on {source}, with the MLP tiled in {shards} shards "
                    f"(nothing fits untiled): {why}"
                )
                return MemoryChoice(
                    policy, policy_why, shards, _tiled_on(estimates[policy], tiled[policy], shards, budget, source)
                )
    else:
        policy_why = f"memory.activation_checkpointing: {policy}"
    knobs = Knobs(
        policy if policy in POLICIES_BY_SPEED else "none", loss, device=kind, host_budget=host_budget, param_shards=param_shards
    )
    tiled = decide_tiled_mlp(cfg, knobs, budget, source)
    return MemoryChoice(policy, policy_why, tiled.shards, tiled.why, tiled.does_not_fit)


def _auto_policies(cfg: HoneConfig) -> tuple[tuple[str, ...], str]:
    """The policies ``auto`` may choose from for ``cfg``, and why not all: explicit tiled layers
    are the layer's checkpoint (full or offload); a quantized base asks for little memory, so
    ``auto`` never keeps every activation (``none``) and ``selective`` keeps the least the compiler
    may (:func:`selective_budget_choice`): qwen3-8b QLoRA at seq 2048 on an H100, 285 ms at 9.2
    GiB against 330 ms at 7.2 GiB for ``full`` and 212 ms at 16.6 GiB for ``none``."""
    if cfg.memory.tiled_layers_chunks:
        return INPUT_ONLY_POLICIES, f", memory.tiled_layers: {cfg.memory.tiled_layers} needs full or offload"
    if cfg.model.quantize != "none":
        return (
            "selective",
            *INPUT_ONLY_POLICIES,
        ), f", a quantized base (model.quantize: {cfg.model.quantize}) asks for little memory"
    return POLICIES_BY_SPEED, ""


def selective_budget_choice(
    cfg: HoneConfig, device: Any, shards: int, budget: int | None = None, *, host_budget: int | None = None, param_shards: int = 1
) -> tuple[float, str]:
    """(budget, why) of ``memory.selective_memory_budget`` for ``selective`` under Inductor with
    the MLP in ``shards``: as written, or for ``auto`` the largest budget, from 1 down in steps
    of :data:`SELECTIVE_BUDGET_STEP` to the floor (:func:`selective_budget_floor`), whose estimated peak fits
    the card with the ``auto`` margin (a larger budget recomputes less: 145 ms at 0.5 against
    159 ms at 0.2 for qwen3-8b at seq 2048 on an H100); with a quantized base, the floor."""
    asked = cfg.memory.selective_memory_budget
    if asked != "auto":
        return asked, f"memory.selective_memory_budget: {asked}"
    floor = selective_budget_floor(cfg.distributed.expert_parallel)
    if cfg.model.quantize != "none":
        return floor, (
            f"selective_memory_budget: auto: {floor}, the least memory (a quantized base, "
            f"model.quantize: {cfg.model.quantize}, asks for little)"
        )
    kind, budget, source = _budget(device, budget)
    if host_budget is None:
        host_budget = host_memory(None)[0]
    usable, limit = auto_limit(budget, source)
    knobs = Knobs("selective", loss_of(cfg), device=kind, tiled_mlp=shards, host_budget=host_budget, param_shards=param_shards)
    steps = round((1 - floor) / SELECTIVE_BUDGET_STEP)
    for i in range(steps + 1):
        fraction = round(1 - i * SELECTIVE_BUDGET_STEP, 2)
        total = estimate_memory(cfg, replace(knobs, selective_budget=fraction)).total
        if total <= usable:
            return fraction, f"selective_memory_budget: auto: {fraction}, the largest that fits ({gib(total)} <= {limit})"
    return floor, f"selective_memory_budget: auto: {floor}, the floor (no budget fits {limit})"


def _tiled_on(untiled: int, tiled: int, shards: int, budget: int, source: str) -> str:
    return (
        f"tiled_mlp: auto: {shards} shards, the MLP's [tokens x intermediate] activations are what does not fit: "
        f"untiled {gib(untiled)}, tiled {gib(tiled)} <= {auto_limit(budget, source)[1]}"
    )


def plan_memory(
    cfg: HoneConfig, device: Any, budget: int | None = None, *, host_budget: int | None = None, param_shards: int = 1
) -> MemoryChoice:
    """The checkpointing policy and MLP tiling a plan runs with, and why: explicit settings as
    written, ``auto`` ones by :func:`decide_memory` (one call for both). For ``tiled_mlp: auto``
    a model the estimate cannot read is left untiled, with the reason: ``auto`` is the default,
    and a run must not fail on a switch it never asked for; ``activation_checkpointing: auto``
    needs the estimate and fails with it. ``auto`` checkpointing picks the fastest policy whose
    estimated peak fits the device's memory with a margin (offload only on CUDA, where its side
    streams overlap the copies; selective estimated at its least memory under Inductor, the
    budget then chosen by :func:`selective_budget_choice`), the MLP tiled only where nothing fits
    untiled. Where the estimate cannot read the model, the default ``auto`` (not written by the
    user) runs ``none``."""
    memory = cfg.memory
    policy = memory.checkpointing
    shards = memory.tiled_mlp_shards or 0
    written = MemoryChoice(policy, f"memory.activation_checkpointing: {policy}", shards, f"memory.tiled_mlp: {memory.tiled_mlp}")
    if memory.tiled_mlp != "auto" and policy != "auto":
        return written
    try:
        decided = decide_memory(cfg, device, budget, host_budget=host_budget, param_shards=param_shards)
    except Exception as exc:  # noqa: BLE001 -- the estimate's failure is reported, not raised (unless auto needs it)
        if policy == "auto" and memory.explicitly_set("activation_checkpointing"):
            raise
        failed = f"the memory estimate failed ({type(exc).__name__}: {exc})"
        if policy == "auto":  # the default: a run must not fail on a switch it never asked for
            written = replace(written, policy="none", policy_why=f"activation_checkpointing: auto: none, {failed}")
        return replace(written, shards=0, tiled_why=f"tiled_mlp: auto: off, {failed}", does_not_fit=True)
    if memory.tiled_mlp != "auto":
        return replace(decided, shards=written.shards, tiled_why=written.tiled_why, does_not_fit=False)
    return decided


def tiled_layers_choice(
    cfg: HoneConfig,
    device: Any,
    policy: str,
    tiled_mlp: int,
    budget: int | None = None,
    *,
    host_budget: int | None = None,
    param_shards: int = 1,
) -> TiledDecision:
    """``memory.tiled_layers`` of ``cfg`` under ``policy`` (the checkpointing in force) with the MLP
    in ``tiled_mlp`` shards (the MLP decision), on ``device``: the card and the host default to
    this machine's, as for the other ``auto`` memory settings
    (:func:`hone.transforms.memory.decide.decide_tiled_layers`)."""
    kind, budget, source = _budget(device, budget)
    if host_budget is None:
        host_budget = host_memory(None)[0]
    knobs = Knobs(policy, loss_of(cfg), device=kind, tiled_mlp=tiled_mlp, host_budget=host_budget, param_shards=param_shards)
    return decide_tiled_layers(cfg, knobs, budget, source)


def offload_layers_choice(
    cfg: HoneConfig, layers: int, host_budget: int | None = None, sequence_len: int | None = None
) -> tuple[int | None, str]:
    """``memory.offload_layers`` for a run of ``layers`` decoder layers: (how many layers' inputs
    go to the host, None for all of them; why). ``auto``: all when the host (``host_budget``,
    default this machine's RAM) holds their pinned blocks, else as many as fit it
    (:func:`hone.transforms.memory.terms.offload.offload_split`). With a frozen embedding (LoRA) layer 0's
    input is never offloaded (autograd holds it as a leaf): ``layers - 1`` can be."""
    asked = cfg.memory.offload_layers
    if asked != "auto":
        return (None if asked >= layers else asked), f"memory.offload_layers: {asked} of {layers} layers"
    if host_budget is None:
        host_budget, source = host_memory(None)
    else:
        source = f"{host_budget / GIB:.0f} GiB of host memory"
    facts = model_facts(cfg)
    tokens = cfg.micro_batch_tokens_per_rank(sequence_len)
    input_bytes = facts.compute_bytes * tokens * facts.hidden
    layers -= 0 if facts.embedding_trainable else 1
    count = offload_split(layers, input_bytes, "auto", host_budget)
    block = pinned_block(input_bytes)
    need = f"{layers} x {block / GIB:.2f} GiB pinned + {host_process_bytes(input_bytes) / GIB:.1f} GiB for the process"
    if count >= layers:
        return (
            None,
            f"offload_layers: auto: all {layers} layers' inputs on the host "
            f"({need} fits {source} less a {HOST_MARGIN:.0%} margin)",
        )
    return count, (
        f"offload_layers: auto: {count} of {layers} layers' inputs on the host, the last {layers - count} on the GPU "
        f"({need} does not fit {source} less a {HOST_MARGIN:.0%} margin)"
    )
