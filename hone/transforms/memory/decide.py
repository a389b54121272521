"""What the config asks for and the ``auto`` decisions the estimate makes: the loss, the tiled MLP
and the tiled layers, each within :data:`AUTO_MARGIN` of the card (:func:`auto_limit`)."""

from dataclasses import dataclass, replace

from hone.config.memory import INPUT_ONLY_POLICIES
from hone.config.root import HoneConfig
from hone.transforms.loss import loss_decision
from hone.transforms.memory.estimate import MemoryEstimate, estimate_memory
from hone.transforms.memory.knobs import Knobs, LossKind
from hone.units import gib


def checkpointing_of(cfg: HoneConfig) -> str:
    """The policy the config asks for (none/full/selective/offload/auto; the boolean alias
    ``memory.gradient_checkpointing`` resolved)."""
    return cfg.memory.checkpointing


def loss_of(cfg: HoneConfig) -> LossKind:
    """The loss the run will use (:func:`hone.transforms.loss.loss_decision`)."""
    return loss_decision(cfg)[0]  # type: ignore[return-value]


#: The share of the card an estimate may not use (estimates are not exact, the allocator
#: fragments): the margin of ``activation_checkpointing: auto`` and ``tiled_mlp: auto``.
AUTO_MARGIN = 0.1


@dataclass(frozen=True)
class TiledDecision:
    """``memory.tiled_mlp`` resolved for one checkpointing policy on one card."""

    shards: int
    """0: untiled."""
    why: str
    does_not_fit: bool = False
    """``auto`` left tiling off on a run that does not fit even tiled (worth recording)."""


def usable_bytes(budget: int) -> int:
    """The bytes of a ``budget``-byte card an estimate may use: the card less :data:`AUTO_MARGIN`."""
    return int(budget * (1 - AUTO_MARGIN))


def fits_within(est: MemoryEstimate, budget: int, host_budget: int | None = None) -> bool:
    """The one meaning of "fits": what ``auto`` decides by, what ``hone plan``'s verdict and
    fits rows say, and what its longest sequence is searched by: the estimated peak within the
    card less :data:`AUTO_MARGIN`, and (``host_budget`` given) the process's host memory within that."""
    return est.total <= usable_bytes(budget) and (host_budget is None or est.host_total <= host_budget)


def auto_limit(budget: int, source: str) -> tuple[int, str]:
    """What an ``auto`` memory decision may use of a ``budget``-byte card, and how to say it."""
    limit = usable_bytes(budget)
    return limit, f"{gib(limit)} ({source} less a {AUTO_MARGIN:.0%} margin)"


def decide_tiled_mlp(cfg: HoneConfig, knobs: Knobs, budget: int, source: str) -> TiledDecision:
    """``tiled_mlp`` of the step ``knobs`` describes (its ``tiled_mlp`` aside) on a card of
    ``budget`` bytes (``source``: where that number comes from, for the reason). An explicit
    count or ``off`` is taken as written; ``auto`` tiles only when the untiled estimate does not
    fit (less :data:`AUTO_MARGIN`) and the tiled one, in
    :func:`~hone.transforms.memory.terms.tiled_mlp.auto_tiled_shards` shards, does: the MLP's
    [tokens x intermediate] activations are then what does not fit. ``knobs.param_shards``:
    FSDP's share of the weights per process (a sharded run has more room for activations);
    ``knobs.host_budget``: the host memory an ``offload`` split is decided on."""
    configured = cfg.memory.tiled_mlp_shards
    if configured is not None:
        return TiledDecision(configured, f"memory.tiled_mlp: {cfg.memory.tiled_mlp}")
    usable, limit = auto_limit(budget, source)
    untiled = estimate_memory(cfg, replace(knobs, tiled_mlp=0)).total
    if untiled <= usable:
        return TiledDecision(0, f"tiled_mlp: auto: the run fits untiled ({gib(untiled)} <= {limit})")
    tiled = estimate_memory(cfg, replace(knobs, tiled_mlp="auto"))
    if tiled.total <= usable:
        return TiledDecision(
            tiled.tiled_mlp,
            f"tiled_mlp: auto: {tiled.tiled_mlp} shards, the MLP's [tokens x intermediate] activations are what does not "
            f"fit: untiled {gib(untiled)}, tiled {gib(tiled.total)} <= {limit}",
        )
    return TiledDecision(
        0,
        f"tiled_mlp: auto: off, the run does not fit tiled either ({gib(untiled)} untiled, {gib(tiled.total)} "
        f"in {tiled.tiled_mlp} shards, > {limit}): tiling alone would not make it fit",
        does_not_fit=True,
    )


def decide_tiled_layers(cfg: HoneConfig, knobs: Knobs, budget: int, source: str) -> TiledDecision:
    """``memory.tiled_layers`` of the step ``knobs`` describes (its ``tiled_layers`` aside; its
    ``tiled_mlp``: the MLP decision) on a card of ``budget`` bytes: a count or ``off`` as written;
    ``auto`` chunks the layers (:func:`~hone.transforms.memory.terms.tiled_layers.auto_layer_chunks`)
    only under ``full`` or ``offload`` and only when the run does not fit whole and does fit
    chunked: the layer rebuilt in the backward is then what does not fit."""
    configured = cfg.memory.tiled_layers_chunks
    if configured is not None:
        return TiledDecision(configured, f"memory.tiled_layers: {cfg.memory.tiled_layers}")
    policy = knobs.checkpointing
    if policy not in INPUT_ONLY_POLICIES:
        why = f"tiled_layers: auto: off, checkpointing {policy} (tiled layers are a form of full checkpointing)"
        return TiledDecision(0, why)
    usable, limit = auto_limit(budget, source)
    whole = estimate_memory(cfg, replace(knobs, tiled_layers=0)).total
    if whole <= usable:
        return TiledDecision(0, f"tiled_layers: auto: off, the run fits with whole layers ({gib(whole)} <= {limit})")
    chunked = estimate_memory(cfg, replace(knobs, tiled_layers="auto"))
    if chunked.total <= usable:
        return TiledDecision(
            chunked.tiled_layers,
            f"tiled_layers: auto: {chunked.tiled_layers} chunks, the layer rebuilt in the backward is what does not fit: "
            f"whole {gib(whole)}, chunked {gib(chunked.total)} <= {limit}",
        )
    return TiledDecision(
        0,
        f"tiled_layers: auto: off, the run does not fit chunked either ({gib(whole)} whole, {gib(chunked.total)} "
        f"in {chunked.tiled_layers} chunks, > {limit})",
        does_not_fit=True,
    )
