"""Layer-run checkpointing: one saved input per run of k consecutive decoder layers.

Why: under ``full`` or ``offload`` checkpointing every decoder layer keeps its input for the
backward, ``batch x seq x hidden`` elements each. At 512K tokens a qwen3-8b layer input is 4 GiB:
the 36 of them (144 GiB) fit neither the card nor a 128 GiB host beside the weights. Keeping only
the first input of each run of k layers divides that by k (runs of two: 72 GiB, all on the host),
for the price of one more forward of the run's other k-1 layers in the backward.

How:

- :class:`RunLayer` stands in for each decoder layer instance (it shares the layer's children, so
  names and state dicts are unchanged) and wraps whatever is there: the checkpointed layer, or a
  tiled layer (:mod:`hone.transforms.tiled_layers`). In a training forward it records, for its
  run, the layer's keyword arguments (RoPE tables, masks, positions: shared by every layer and
  alive anyway) and, with dropout, the RNG state it started from.
- :class:`LayerRuns` holds the saved-tensor hooks of each micro-batch (:meth:`LayerRuns.step_context`).
  While layer j runs, the tensor its checkpoint saves as its input (torch's checkpoint saves its
  inputs with an ordinary ``save_for_backward``, so does the tiled layer) is recognised by its
  storage: a run's first layer's input is kept (on the device, or handed on to the offloader,
  :class:`~hone.transforms.offload.OffloadActivations`, so ``memory.offload_layers`` counts runs);
  the inputs of the run's other layers are not kept at all: autograd gets a small handle instead.
- In the backward, the first handle of a run that autograd unpacks (its last layer's input) rebuilds
  the run: the first input comes back (from the host under ``offload``) and the run's first k-1
  layers are run once more, with grad enabled as in the forward (so compiled layers run the graphs
  they compiled, with no recompile) but with the result detached (the rebuild's graph is dropped at
  once), each under the forward's autocast and RNG state. Their outputs are the run's inner inputs,
  handed to autograd one by one as the backward reaches each layer, which is then recomputed and
  differentiated as today: one layer's activations at a time, plus the run's not yet consumed
  inputs (at most k).

It is exact: the rebuilt inputs are the forward's, computed by the same code on the same inputs
(bitwise, where the kernels are deterministic); gradients equal no checkpointing's up to rounding.

Composition: it needs each layer to keep only its input (``full`` or ``offload``; a tiled layer is
its layer's checkpoint); a tiled MLP inside composes; regional compile compiles the innermost layer
(stand-ins nest). Not composed here: a whole-model graph (it would trace the hooks' bookkeeping),
FSDP2 (the rebuild would gather the layers' weights again, untested) and expert parallelism (the
rebuild would rerun the exchanges on their own). Context parallelism composes: the rebuild of a run
reruns its layers' attention all-to-alls, and every rank of the group rebuilds the same runs in
the same order of the backward (as the recompute of a checkpointed layer does), so the exchanges
pair up (tests/distributed/test_context_parallel_training.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from hone.config.memory import INPUT_ONLY_POLICIES
from hone.config.root import HoneConfig
from hone.errors import HoneError
from hone.models.structure import decoder_layers, unwrap_peft
from hone.transforms.base import PlanContext, RunFacts, Transform
from hone.transforms.card import device_memory, host_memory
from hone.transforms.checkpointing import offloader_for, take_over_step_hooks
from hone.transforms.memory.decide import auto_limit, fits_within, loss_of
from hone.transforms.memory.estimate import MemoryEstimate, estimate_memory
from hone.transforms.memory.knobs import Knobs
from hone.transforms.offload import OffloadActivations
from hone.transforms.recompute import Replay, has_dropout
from hone.transforms.stand_in import StandIn
from hone.transforms.tiled_layers import layers_attend_otherwise, tiled_layers_blockers
from hone.units import gib

__all__ = [
    "LAYER_RUNS",
    "MAX_AUTO_RUN",
    "LayerRuns",
    "LayerRunsError",
    "RunLayer",
    "RunStats",
    "RunsDecision",
    "apply_layer_runs",
    "decide_run_layers",
    "layer_runs_blockers",
    "layer_runs_for",
    "run_bounds",
]


class LayerRunsError(HoneError):
    """The model's decoder layers cannot be checkpointed in runs the way the config asks."""


def run_bounds(layers: int, length: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of ``length`` consecutive layers, in forward order; the last
    run is shorter where ``length`` does not divide ``layers``."""
    if length < 1:
        raise ValueError(f"a run has at least one layer, got {length}")
    return [(s, min(s + length, layers)) for s in range(0, layers, length)]


def _signature(t: torch.Tensor) -> tuple[Any, ...]:
    """What identifies one tensor's memory without keeping a reference to it."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _whole_storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s memory where ``t`` is all of it, laid out row-major from the start:
    any view of that memory is then a view of ``t``, rebuilt by the same geometry on a rebuilt
    ``t``; None otherwise."""
    if t.storage_offset() != 0 or not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return None
    return t.untyped_storage().data_ptr()


def _hidden(out: Any) -> torch.Tensor:
    """A decoder layer's hidden states (transformers layers return them alone or first in a tuple)."""
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if not isinstance(out, torch.Tensor):
        raise LayerRunsError(
            f"memory.checkpoint_run_layers: a decoder layer returned {type(out).__name__}, not its hidden states; "
            "set memory.checkpoint_run_layers: 1 for this model"
        )
    return out


@dataclass
class RunStats:
    """What went through the hooks in the last micro-batch (for tests and the record)."""

    first_saved: int = 0  # runs whose first input was kept (or offloaded)
    inner_dropped: int = 0  # inner layer inputs autograd got a handle for instead
    rebuilds: int = 0  # runs rebuilt in the backward
    rebuilt_layers: int = 0  # layer forwards the rebuilds ran


@dataclass
class _Run:
    """One run of one forward: each layer's call (forward order) and its saved input's handles."""

    start: int = 0  # the index of the run's first layer
    calls: list[tuple[nn.Module, tuple[Any, ...], dict[str, Any], bool]] = field(default_factory=list)
    """Each layer's call: the layer, its other arguments, and whether its input required grad."""
    replay: Replay | None = None
    first: Any = None  # the packed first input (the tensor, or the offloader's handle)
    pending: dict[int, int] = field(default_factory=dict)  # position -> handles not yet unpacked
    rebuilt: dict[int, torch.Tensor] | None = None
    out: tuple[Any, ...] | None = None  # the signature of the last recorded layer's output


class _Handle:
    """What autograd keeps instead of a layer input of a run: the run, the layer's position and,
    where what was saved is a view of the input's memory (a compiled layer may save one), its
    geometry (size, stride, offset) on the rebuilt input."""

    __slots__ = ("position", "run", "view")

    def __init__(self, run: _Run, position: int, view: tuple[Any, ...] | None = None) -> None:
        self.run, self.position, self.view = run, position, view


class LayerRuns:
    """The saved-tensor hooks of layer-run checkpointing for one model (see the module docstring)."""

    def __init__(self, layers: list[nn.Module], length: int, offloader: OffloadActivations | None = None) -> None:
        self.layers = layers
        self.length = length
        self.bounds = run_bounds(len(layers), length)
        self.where = {i: (r, i - s) for r, (s, e) in enumerate(self.bounds) for i in range(s, e)}
        self.offloader = offloader
        self.stats = RunStats()
        self._recording = False
        self._rebuilding = False
        self._runs: dict[int, _Run] = {}
        self._expect: tuple[_Run, int, tuple[Any, ...], int | None, int] | None = None

    @property
    def recording(self) -> bool:
        return self._recording

    @contextmanager
    def step_context(self) -> Iterator[None]:
        """The hooks around one micro-batch's forward and backward (the offloader's session inside)."""
        session = self.offloader.session() if self.offloader is not None else _nothing()
        self.stats = RunStats()
        with session, torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            self._recording, self._runs = True, {}
            try:
                yield
            finally:
                self._recording, self._runs, self._expect = False, {}, None

    # ------------------------------------------------------------------ the forward

    @contextmanager
    def layer_call(self, index: int, layer: nn.Module, x: torch.Tensor, args: tuple, kwargs: dict) -> Iterator[Callable]:
        """Around layer ``index``'s call in a training forward: records it in its run and marks its
        input, so that the save of that input gets a run's handle; yields a callback for the output."""
        r, position = self.where[index]
        if position == 0:
            s, e = self.bounds[r]
            self._runs[r] = _Run(start=s, replay=Replay(x, any(has_dropout(m) for m in self.layers[s:e])))
        run = self._runs.get(r)
        if run is None or len(run.calls) != position or (position > 0 and run.out != _signature(x)):
            raise LayerRunsError(
                f"memory.checkpoint_run_layers: decoder layer {index} did not receive the output of layer {index - 1} "
                "(something runs between the layers, or they run out of order), so its input cannot be rebuilt from "
                "the run's first input; set memory.checkpoint_run_layers: 1 for this model"
            )
        run.calls.append((layer, args, kwargs, x.requires_grad))
        assert run.replay is not None
        run.replay.capture()
        self._expect = (run, position, _signature(x), _whole_storage(x), x._version)
        try:
            yield lambda out: setattr(run, "out", _signature(_hidden(out)))
        finally:
            self._expect = None
        if position == 0 and run.first is None:
            # nothing saved the run's first input (it needs no gradient, nor does the layer): a later
            # layer of the run may still need it rebuilt from there
            run.first = self.offloader.pack(x) if self.offloader is not None else x

    # ------------------------------------------------------------------ hooks

    def _pack(self, tensor: torch.Tensor) -> Any:
        expect = self._expect
        if self._rebuilding or expect is None:
            return self._pass(tensor)
        run, position, signature, whole, version = expect
        view = None
        if tensor._version != version:  # changed in place since the layer got it: not what a rebuild gives
            return self._pass(tensor)
        if _signature(tensor) != signature:
            same_memory = whole is not None and tensor.untyped_storage().data_ptr() == whole
            if position == 0 or not same_memory or tensor.dtype != signature[4] or tensor.layout != torch.strided:
                return self._pass(tensor)
            view = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        if position == 0 and run.first is None:
            run.first = self.offloader.pack(tensor) if self.offloader is not None else tensor
            self.stats.first_saved += 1
        elif position > 0 and position not in run.pending:
            self.stats.inner_dropped += 1
        run.pending[position] = run.pending.get(position, 0) + 1
        return _Handle(run, position, view)

    def _pass(self, tensor: torch.Tensor) -> Any:
        """Anything but a run's layer input: the offloader's (when it is on), else kept as it is."""
        return self.offloader.pack(tensor) if self.offloader is not None and not self._rebuilding else tensor

    def _unpack(self, handle: Any) -> torch.Tensor:
        if not isinstance(handle, _Handle):
            return self.offloader.unpack(handle) if self.offloader is not None else handle
        run, position = handle.run, handle.position
        if run.rebuilt is None:
            self._rebuild(run)
        assert run.rebuilt is not None
        tensor = run.rebuilt[position]
        if handle.view is not None:
            tensor = tensor.contiguous().as_strided(*handle.view)
        run.pending[position] -= 1
        if run.pending[position] == 0:
            del run.rebuilt[position]
        return tensor

    def _rebuild(self, run: _Run) -> None:
        """The run's inputs: the first one back, the others from one more forward of the run's
        first k-1 layers (grad on as in the forward; the rebuild's graph is dropped at once)."""
        if run.first is None:
            raise LayerRunsError("memory.checkpoint_run_layers: a run's first input was never saved; cannot rebuild the run")
        first, run.first = run.first, None
        x = self.offloader.unpack(first) if self.offloader is not None else first
        rebuilt = {0: x}
        assert run.replay is not None
        self._rebuilding = True
        try:
            for position, (layer, args, kwargs, wanted_grad) in enumerate(run.calls[:-1]):
                # the input as the forward's was (requiring grad or not): a compiled layer guards on it
                given = rebuilt[position].detach().requires_grad_(wanted_grad)
                with run.replay.context(position, grad=True):
                    out = _hidden(layer(given, *args, **kwargs))
                rebuilt[position + 1] = out.detach()
                self.stats.rebuilt_layers += 1
                del out, given
        finally:
            self._rebuilding = False
        run.rebuilt = {p: t for p, t in rebuilt.items() if run.pending.get(p)}  # what autograd will ask for
        self.stats.rebuilds += 1


@contextmanager
def _nothing() -> Iterator[None]:
    yield


class RunLayer(StandIn):
    """Stands in for a decoder layer (or a tiled layer) and records its calls in a training forward
    for :class:`LayerRuns`; otherwise (no grad, no micro-batch context) it is the layer's own call."""

    stands_in_for_decoder_layer = True

    def __init__(self, layer: nn.Module, index: int, runs: LayerRuns) -> None:
        super().__init__(layer, max(runs.length, 2), "layers per run")
        self.index = index
        self.__dict__["runs"] = runs  # not a module, and shared by every layer

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        runs: LayerRuns = self.__dict__["runs"]
        if not (runs.recording and torch.is_grad_enabled()):
            return self.inner(hidden_states, *args, **kwargs)
        with runs.layer_call(self.index, self.inner, hidden_states, args, kwargs) as seen_output:
            out = self.inner(hidden_states, *args, **kwargs)
            seen_output(out)
        return out

    def extra_repr(self) -> str:
        return f"index={self.index}, run_layers={self.__dict__['runs'].length}, layer={type(self.inner).__name__}"


_RUNS: weakref.WeakKeyDictionary[nn.Module, LayerRuns] = weakref.WeakKeyDictionary()


def layer_runs_for(model: nn.Module) -> LayerRuns | None:
    """The :class:`LayerRuns` :func:`apply_layer_runs` attached to ``model``, if any."""
    return _RUNS.get(model)


def apply_layer_runs(model: nn.Module, length: int) -> dict[str, Any]:
    """Checkpoint ``model``'s decoder layers (already checkpointed, or tiled) in runs of ``length``:
    each layer replaced by a :class:`RunLayer`, and the micro-batch context of ``model`` becomes
    the runs' hooks, which hand the runs' first inputs on to the ``offload`` policy's offloader
    where there is one. Returns what was done, for optimizations.json. Apply after activation
    checkpointing and tiled layers, before compile."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise ValueError(f"a layer run has 2 or more layers here (1 is plain checkpointing), got {length!r}")
    base = unwrap_peft(model)
    layers = decoder_layers(model)
    if not layers:
        raise LayerRunsError(f"memory.checkpoint_run_layers: found no decoder layers in {type(base).__name__}; set it to 1")
    if any(isinstance(layer, RunLayer) for layer in layers):
        raise LayerRunsError("memory.checkpoint_run_layers: the model's layers are already checkpointed in runs")
    offloader = offloader_for(model)
    runs = LayerRuns(layers, length, offloader)
    lists = [m for m in base.modules() if isinstance(m, nn.ModuleList)]
    for index, layer in enumerate(layers):
        owner = next(((ml, i) for ml in lists for i, m in enumerate(ml) if m is layer), None)
        if owner is None:
            raise LayerRunsError(
                f"memory.checkpoint_run_layers: {type(layer).__name__} is not held in a ModuleList of "
                f"{type(base).__name__}; set memory.checkpoint_run_layers: 1 for this model"
            )
        owner[0][owner[1]] = RunLayer(layer, index, runs)
    _RUNS[model] = runs
    _RUNS[base] = runs
    take_over_step_hooks(model, runs.step_context)
    return {
        "layers_per_run": length,
        "runs": len(runs.bounds),
        "layers": len(layers),
        "saved_inputs": f"{len(runs.bounds)} (one per run) instead of {len(layers)}",
        "offloaded_runs": None
        if offloader is None
        else ("all" if offloader.max_tensors is None else min(offloader.max_tensors, len(runs.bounds))),
    }


# ---------------------------------------------------------------------------------- the decision

#: ``checkpoint_run_layers: auto`` tries runs up to this long: each step up saves one more input
#: per run less (a half, a third, ...) and costs the rebuild of one more layer per run.
MAX_AUTO_RUN = 4


@dataclass(frozen=True)
class RunsDecision:
    """``memory.checkpoint_run_layers`` resolved, with the tiling it was decided with: where runs
    are what fits, ``auto`` tiling (MLP shards, layer chunks) that was left off because it alone did
    not make the run fit is turned on with them."""

    layers: int
    why: str
    mlp_shards: int
    chunks: int
    tiling_why: str | None = None
    """Set when the tiling changed from the MLP and tiled-layers decisions (and why)."""


def layer_runs_blockers(cfg: HoneConfig, device_type: str, strategy: str, expert_parallel: int = 1) -> list[str]:
    """What rules layer runs out for this run beyond the config's own validator: the problems of an
    explicit count, the reason ``auto`` keeps one input per layer."""
    blockers = []
    if strategy == "fsdp":
        blockers.append(
            "layer runs are untested under FSDP2 (distributed.strategy resolves to fsdp): use distributed.strategy: ddp"
        )
    if expert_parallel > 1:
        blockers.append("the rebuild of a run would rerun the expert-parallel exchanges on one rank's backward alone")
    if cfg.performance.compiles_on(device_type) and cfg.performance.torch_compile_scope == "model":
        blockers.append("layer runs need torch_compile_scope: regional (a whole-model graph would trace the runs' bookkeeping)")
    return blockers


def decide_run_layers(
    cfg: HoneConfig, facts: RunFacts, policy: str, tiling: tuple[int, int], *, strategy: str, expert_parallel: int = 1
) -> RunsDecision:
    """``memory.checkpoint_run_layers`` under the checkpointing ``policy`` with ``tiling`` = (MLP
    shards, layer chunks) as decided: a count as written; ``auto`` keeps one input per layer
    wherever that fits (GPU and host, less the ``auto`` margin) and otherwise takes the shortest
    runs (2 .. :data:`MAX_AUTO_RUN`) that make the run fit, turning on an ``auto`` tiling that was
    left off where the runs need it too. Never fails a run: where the estimate fails, 1."""
    shards, chunks = tiling
    configured = cfg.memory.run_layers
    if configured is not None:
        return RunsDecision(configured, f"memory.checkpoint_run_layers: {configured}", shards, chunks)
    if policy not in INPUT_ONLY_POLICIES:
        return RunsDecision(
            1, f"checkpoint_run_layers: auto: 1, checkpointing {policy} keeps more than the layers' inputs", shards, chunks
        )
    blockers = layer_runs_blockers(cfg, facts.device.type, strategy, expert_parallel)
    if blockers:
        return RunsDecision(1, f"checkpoint_run_layers: auto: 1, {blockers[0]}", shards, chunks)
    try:
        return _auto_runs(cfg, facts, policy, shards, chunks, strategy)
    except Exception as exc:  # noqa: BLE001 -- the estimate's failure is reported, not raised
        return RunsDecision(
            1, f"checkpoint_run_layers: auto: 1, the memory estimate failed ({type(exc).__name__}: {exc})", shards, chunks
        )


def _auto_runs(cfg: HoneConfig, facts: RunFacts, policy: str, shards: int, chunks: int, strategy: str) -> RunsDecision:
    kind = facts.device.type
    if facts.memory_bytes is not None:
        budget, source = facts.memory_bytes, f"a {gib(facts.memory_bytes)} card"
    else:
        budget, source = device_memory(kind, None)
    host = facts.host_memory_bytes if facts.host_memory_bytes is not None else host_memory(None)[0]
    param_shards = facts.world.world_size if strategy == "fsdp" else 1
    base = Knobs(
        policy, loss_of(cfg), device=kind, tiled_mlp=shards, tiled_layers=chunks, host_budget=host, param_shards=param_shards
    )

    def estimate(**change: Any) -> MemoryEstimate:
        return estimate_memory(cfg, replace(base, **change))

    usable, _ = auto_limit(budget, source)
    limit = f"{gib(usable)} of GPU ({source} less a 10% margin) and {gib(host)} of host"
    one = estimate()
    if fits_within(one, budget, host):
        why = f"checkpoint_run_layers: auto: 1, the run fits with one input per layer ({_where(one)} within {limit})"
        return RunsDecision(1, why, shards, chunks)
    tilings = [(shards, chunks)]
    more_mlp = shards == 0 and cfg.memory.tiled_mlp == "auto"
    more_layers = chunks == 0 and cfg.memory.tiled_layers == "auto" and not tiled_layers_blockers(cfg, kind, strategy)
    if (more_mlp or more_layers) and not (more_layers and layers_attend_otherwise(cfg)):
        tilings.append(("auto" if more_mlp else shards, "auto" if more_layers else chunks))
    for length in range(2, MAX_AUTO_RUN + 1):
        for mlp, layer_chunks in tilings:
            est = estimate(run_layers=length, tiled_mlp=mlp, tiled_layers=layer_chunks)
            if not fits_within(est, budget, host):
                continue
            alone = estimate(tiled_mlp=mlp, tiled_layers=layer_chunks)
            why = (
                f"checkpoint_run_layers: auto: {length}, one saved input per run of {length} layers is what fits "
                f"({_where(est)} within {limit}; one input per layer: {_where(alone)})"
            )
            changed = (est.tiled_mlp, est.tiled_layers) != (shards, chunks)
            tiling_why = f"with runs of {length} layers (MLP in {est.tiled_mlp} shards, layers in {est.tiled_layers} chunks)"
            return RunsDecision(length, why, est.tiled_mlp, est.tiled_layers, tiling_why if changed else None)
    last = estimate(run_layers=MAX_AUTO_RUN, tiled_mlp=tilings[-1][0], tiled_layers=tilings[-1][1])
    return RunsDecision(
        1,
        f"checkpoint_run_layers: auto: 1, the run does not fit in runs of up to {MAX_AUTO_RUN} layers either "
        f"({_where(one)} with one input per layer, {_where(last)} in runs of {MAX_AUTO_RUN}; {limit})",
        shards,
        chunks,
    )


def _where(est: MemoryEstimate) -> str:
    return f"GPU {gib(est.total)}, host {gib(est.host_total)}"


# ---------------------------------------------------------------------------------- the transform


def _check(ctx: PlanContext) -> list[str]:
    """What the config validator cannot see: the ``auto`` policy and the run."""
    key = f"memory.checkpoint_run_layers: {ctx.decided.run_layers}"
    problems = []
    if ctx.decided.checkpointing not in INPUT_ONLY_POLICIES:
        problems.append(
            f"{key} needs memory.activation_checkpointing full or offload, but it resolves to "
            f"{ctx.decided.checkpointing}: set activation_checkpointing: full or offload"
        )
    blockers = layer_runs_blockers(ctx.cfg, ctx.facts.device.type, ctx.decided.strategy, ctx.decided.expert_parallel)
    return problems + [f"{key}: {b}" for b in blockers]


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    details = apply_layer_runs(model, ctx.decided.run_layers)
    details["why"] = ctx.decided.run_layers_why
    return details


LAYER_RUNS = Transform(
    name="layer_runs",
    switch="memory.checkpoint_run_layers",
    wanted=lambda ctx: ctx.decided.run_layers >= 2,
    why=lambda ctx: ctx.decided.run_layers_why,
    check=_check,
    model=_apply,
    label=lambda d: f"layer runs ({d['layers_per_run']} layers per saved input, {d['runs']} runs)",
)
