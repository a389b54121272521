"""Tiled decoder layers: each decoder layer computed in chunks of the sequence, forward and backward.

Why: under activation checkpointing (``full`` or ``offload``) every layer keeps only its input,
and the backward rebuilds one layer at a time. At long context that one rebuilt layer is what no
longer fits: its norms' outputs, q/k/v, the attention output, the residual, LoRA's input copies
... are ~31 GiB at 512K tokens for qwen3-8b. Computing the layer in chunks of the sequence
(the queries), both in the forward and in the backward's recompute, bounds that to one chunk's
activations, plus the full-length keys and values (small with GQA: 1 GiB each at 512K) and their
float32 gradient sums.

How:

- :class:`TiledDecoderLayer` takes the place of a decoder layer instance in the decoder's
  ``ModuleList`` and shares the original's children, parameters and buffers (the same dicts), so
  parameter names, state dicts and PEFT adapter keys are unchanged; the original is kept,
  unregistered, as ``inner`` and called for each chunk with its own forward and hooks.
- :class:`_TiledLayerFunction` (a ``torch.autograd.Function``) is the layer's checkpoint: it saves
  only the layer's input (``save_for_backward``, so the ``offload`` policy's saved-tensor hooks move
  exactly that tensor to the host, as with torch's checkpoint). Its forward runs the layer chunk by
  chunk under ``no_grad``; every per-token keyword argument (RoPE's ``cos``/``sin``,
  ``position_ids``, ``cache_position``) is cut to the chunk, and the attention
  (:mod:`hone.models.attention.tiled`) lets the chunk's queries attend to all keys before and
  within the chunk, which it keeps in full-length buffers as the chunks go.
- Its backward walks the chunks in reverse. It first rebuilds the keys and values of every chunk
  but the last (a no-grad pass stopped right after each chunk's key projection, RoPE included),
  then for each chunk recomputes it with grad and differentiates it with one
  ``torch.autograd.grad`` over (the chunk's output, its own keys and values), feeding the keys and
  values the gradient the later chunks sent them, with respect to (the chunk's input, the
  trainable parameters, the earlier chunks' keys and values). The earlier chunks' key and value
  gradients are summed in float32 buffers; the parameter gradients are summed in float32 and
  *returned* (the parameters are inputs of the Function, as in :mod:`hone.transforms.tiled_mlp`):
  each parameter's gradient reaches its ``AccumulateGrad`` once per backward, with no hooks and
  no ``.grad`` writes, so DDP's reduction sees one gradient per parameter.
- Each chunk's recompute restores the forward's autocast state and, when the layer holds a
  dropout (LoRA dropout, attention dropout), that chunk's RNG state.

It is exact: the same attention, the same everything, only the rounding differs.

Cost: beside the recompute checkpointing already does, each chunk's attention covers exactly its
causal share (no extra attention FLOPs); the backward's key pass reruns the layer up to the key
and value projections for every chunk but the last (the norm, q/k/v projections and RoPE: 13% of
a qwen3-8b layer's weight matmuls, none of its attention, which dominates at long context); the
prefix of keys and values is copied once per chunk (``cat``), and the matmuls are ``chunks`` times
smaller.

Composition: it *is* the layer's checkpoint, so it needs ``memory.activation_checkpointing``
``full`` or ``offload``, and it is applied after checkpointing (transformers' checkpointing flag
is then switched off on the inner layer, whose chunk recompute must not be checkpointed again)
and before compile: regional compile compiles the inner layer (``layer.inner.compile()``), so the
chunks run compiled, in two graphs around the eager chunk attention. A tiled MLP inside the layer
composes (chunks of chunks). Not composed here: packed rows (a document mask), FSDP2 (untested),
MoE models that record router logits from hooks.

As a transform (:data:`TILED_LAYERS`) it runs with the chunk count the plan decided
(``memory.tiled_layers``; ``auto`` chunks the layers only where the memory estimate says the
layer rebuilt in the backward is what does not fit, and never fails a run: where tiled layers
cannot apply, or the estimate fails, the layers stay whole).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hone.config.memory import INPUT_ONLY_POLICIES
from hone.config.root import HoneConfig
from hone.errors import HoneError
from hone.models.attention.causal import CAUSAL_SDPA
from hone.models.attention.setup import causal_blockers
from hone.models.attention.tiled import (
    TILED_SDPA,
    ChunkAttention,
    KeysCollected,
    computing_chunk,
    register_tiled_sdpa,
)
from hone.models.structure import decoder_layers, unwrap_peft
from hone.transforms.auto_policy import tiled_layers_choice
from hone.transforms.base import PlanContext, RunFacts, Transform
from hone.transforms.memory.facts import transformers_config
from hone.transforms.recompute import GradSums, Replay, has_dropout
from hone.transforms.stand_in import StandIn
from hone.transforms.tiled_mlp import shard_sizes

__all__ = [
    "TILED_LAYERS",
    "TiledDecoderLayer",
    "TiledLayersError",
    "apply_tiled_layers",
    "chunk_bounds",
    "decide_chunks",
    "tiled_layer_forward",
    "tiled_layers_blockers",
]


class TiledLayersError(HoneError):
    """The model's decoder layers cannot be tiled the way the config asks."""


def chunk_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk of a sequence of ``length`` positions: ``ceil(length /
    chunks)`` each, the last one shorter when they do not divide (tiled MLP's shard sizes)."""
    bounds, at = [], 0
    for size in shard_sizes(length, chunks):
        bounds.append((at, at + size))
        at += size
    return bounds


# ---------------------------------------------------------------------------------- chunk inputs

#: Keyword arguments that carry one entry per position, and the dimension of the positions.
_PER_TOKEN: dict[str, int] = {"position_embeddings": 1, "position_ids": 1, "cache_position": 0}


def _chunk_kwargs(kwargs: dict[str, Any], length: int, bounds: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """The layer's keyword arguments for each chunk: per-token ones cut to the chunk, the rest as
    they are. Anything else shaped by the sequence is refused (it could not be cut safely)."""
    if kwargs.get("attention_mask") is not None:
        raise TiledLayersError(
            "memory.tiled_layers: the decoder layer got an attention mask (packed rows, or a backend that prepares "
            "masks); tiled layers compute causal rows without a mask. Set data.sample_packing: false, or "
            "memory.tiled_layers: off"
        )
    for name in ("cache", "past_key_values", "past_key_value", "layer_past"):
        if kwargs.get(name) is not None:
            raise TiledLayersError(
                f"memory.tiled_layers: the decoder layer got a KV cache ({name}); tiled layers train without one. "
                "Set memory.tiled_layers: off to train with a cache"
            )
    for name, value in kwargs.items():
        if name in _PER_TOKEN:
            continue
        tensors = value if isinstance(value, (tuple, list)) else (value,)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() > 0 and length in t.shape:
                raise TiledLayersError(
                    f"memory.tiled_layers: the decoder layer got {name} of shape {tuple(t.shape)}, shaped like the "
                    f"sequence ({length}) but not known to be per token; it cannot be cut into chunks. Set "
                    "memory.tiled_layers: off for this model"
                )
    for name, dim in _PER_TOKEN.items():
        tensors = kwargs.get(name)
        for t in tensors if isinstance(tensors, (tuple, list)) else (tensors,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise TiledLayersError(f"memory.tiled_layers: {name} requires grad; tiled layers take fixed positions only")
            if isinstance(t, torch.Tensor) and (t.dim() <= dim or t.shape[dim] != length):
                raise TiledLayersError(
                    f"memory.tiled_layers: {name} has shape {tuple(t.shape)}, not {length} positions along dimension "
                    f"{dim}; set memory.tiled_layers: off for this model"
                )

    def cut(value: Any, dim: int, s: int, e: int) -> Any:
        if isinstance(value, torch.Tensor):
            return value.narrow(dim, s, e - s)
        if isinstance(value, (tuple, list)):
            return type(value)(cut(v, dim, s, e) for v in value)
        return value

    return [{k: cut(v, _PER_TOKEN[k], s, e) if k in _PER_TOKEN else v for k, v in kwargs.items()} for s, e in bounds]


# ---------------------------------------------------------------------------------- autograd


def _own(value: Any) -> Any:
    """A chunk's tensor in storage of its own (offset 0, row-major strides): a compiled layer
    guards on storage offsets (0 and 1 are specialised) and on strides, so views at each chunk's
    offset into the whole sequence would compile more graphs. Chunk-sized copies; tuples (RoPE's
    cos, sin) element by element."""
    if isinstance(value, torch.Tensor):
        if value.storage_offset() == 0 and value.stride() == _row_major(value.shape):
            return value
        return value.clone(memory_format=torch.contiguous_format)
    if isinstance(value, (tuple, list)):
        return type(value)(_own(v) for v in value)
    return value


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _run_chunk(layer: nn.Module, x: torch.Tensor, kwargs: dict[str, Any], state: ChunkAttention) -> torch.Tensor:
    """The layer on one chunk, its attention served by ``state``; checks that it went through it."""
    kwargs = {k: _own(v) if k in _PER_TOKEN else v for k, v in kwargs.items()}
    with computing_chunk(state):
        out = layer(x, **kwargs)
    if isinstance(out, (tuple, list)) and len(out) >= 1 and isinstance(out[0], torch.Tensor) and all(o is None for o in out[1:]):
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        raise TiledLayersError(
            f"memory.tiled_layers: {type(layer).__name__} returned {type(out).__name__}"
            + (f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else "")
            + f" for a chunk of shape {tuple(x.shape)}; tiled layers handle layers that return their hidden states. "
            "Set memory.tiled_layers: off for this model"
        )
    if state.calls != 1:
        raise TiledLayersError(
            f"memory.tiled_layers: {type(layer).__name__}'s attention did not go through hone's tiled attention "
            f"(attn_implementation {TILED_SDPA}); set memory.tiled_layers: off for this model"
        )
    return out


class _TiledLayerFunction(torch.autograd.Function):
    """``layer(x, **kwargs)`` computed chunk by chunk of the sequence; see the module docstring.

    ``apply(layer, bounds, chunk_kwargs, x, *params)``: ``params`` are the layer's parameters that
    require grad, passed as inputs so that their gradients leave through autograd's normal path.
    """

    @staticmethod
    def forward(
        ctx: Any,
        layer: nn.Module,
        bounds: list[tuple[int, int]],
        chunk_kwargs: list[dict[str, Any]],
        x: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.layer, ctx.bounds, ctx.chunk_kwargs, ctx.n_params = layer, bounds, chunk_kwargs, len(params)
        ctx.replay = Replay(x, has_dropout(layer))
        out = torch.empty_like(x)
        state = ChunkAttention("forward", total=x.shape[1])
        with torch.no_grad():
            for (s, e), kwargs in zip(bounds, chunk_kwargs):
                ctx.replay.capture()
                out[:, s:e].copy_(_run_chunk(layer, _own(x[:, s:e]), kwargs, state.at(s, e)))
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        n_inputs = 4 + ctx.n_params
        if grad is None:
            return (None,) * n_inputs
        (x,) = ctx.saved_tensors
        layer: nn.Module = ctx.layer
        params = [p for p in layer.parameters() if p.requires_grad]
        if len(params) != ctx.n_params:
            raise RuntimeError(f"tiled layer: {len(params)} trainable parameters in the backward, {ctx.n_params} in the forward")
        wants_x = ctx.needs_input_grad[3]
        wanted = [ctx.needs_input_grad[4 + i] for i in range(len(params))]
        bounds, replay = ctx.bounds, ctx.replay
        state = ChunkAttention("collect", total=x.shape[1])
        # 1. the keys and values of every chunk but the last, as the forward computed them
        for i, (s, e) in enumerate(bounds[:-1]):
            with replay.context(i, grad=False):
                try:
                    _run_chunk(layer, _own(x[:, s:e]), ctx.chunk_kwargs[i], state.at(s, e))
                except KeysCollected:
                    continue
            raise TiledLayersError(f"memory.tiled_layers: {type(layer).__name__} ran without calling its attention")
        # 2. the chunks in reverse, each differentiated once
        prefix_end = bounds[-1][0]  # positions whose keys receive gradient from later chunks
        key_grads: torch.Tensor | None = None
        value_grads: torch.Tensor | None = None
        x_grad = torch.empty_like(x) if wants_x else None
        sums = GradSums(len(params))
        for i in reversed(range(len(bounds))):
            s, e = bounds[i]
            chunk = _own(x[:, s:e].detach()).requires_grad_(wants_x)
            with replay.context(i, grad=True):
                out = _run_chunk(layer, chunk, ctx.chunk_kwargs[i], state.at(s, e, "backward"))
            outputs, grad_outputs = [out], [grad[:, s:e]]
            for live, sent in ((state.live_keys, key_grads), (state.live_values, value_grads)):
                if live is not None and live.requires_grad and sent is not None:
                    outputs.append(live)
                    grad_outputs.append(sent[:, :, s:e].to(live.dtype))
            prefix = [t for t in (state.prefix_keys, state.prefix_values) if t is not None and t.requires_grad]
            inputs = ([chunk] if wants_x else []) + [p for p, w in zip(params, wanted) if w] + prefix
            got: list[torch.Tensor | None] = [None] * len(inputs)
            if out.requires_grad and inputs:
                got = list(torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True))
            if wants_x:
                chunk_grad = got.pop(0)
                assert x_grad is not None
                if chunk_grad is None:
                    x_grad[:, s:e].zero_()
                else:
                    x_grad[:, s:e].copy_(chunk_grad)
            for k in (k for k, w in enumerate(wanted) if w):
                sums.add(k, got.pop(0))
            for leaf, g in zip(prefix, got):
                if g is None:
                    continue
                if leaf is state.prefix_keys:
                    if key_grads is None:
                        key_grads = g.new_zeros(g.shape[:2] + (prefix_end, g.shape[3]), dtype=torch.float32)
                    key_grads[:, :, :s].add_(g)
                else:
                    if value_grads is None:
                        value_grads = g.new_zeros(g.shape[:2] + (prefix_end, g.shape[3]), dtype=torch.float32)
                    value_grads[:, :, :s].add_(g)
            del out, outputs, grad_outputs, got, prefix
            state.at(s, e)  # drops the chunk's live tensors and prefix leaves
        return (None, None, None, x_grad, *sums.result(params))


def tiled_layer_forward(layer: nn.Module, hidden_states: torch.Tensor, chunks: int, **kwargs: Any) -> torch.Tensor:
    """``layer(hidden_states, **kwargs)`` computed in ``chunks`` chunks of the sequence (dimension
    1 of ``[B, T, H]``): the same output and gradients, holding one chunk's activations at a time
    in the backward. The layer's attention must be :data:`~hone.models.attention.tiled.TILED_SDPA`."""
    params = [p for p in layer.parameters() if p.requires_grad]
    length = hidden_states.shape[1]
    bounds = chunk_bounds(length, chunks)
    return _TiledLayerFunction.apply(layer, bounds, _chunk_kwargs(kwargs, length, bounds), hidden_states, *params)


@torch.compiler.disable
def _tiled_boundary(layer: nn.Module, hidden_states: torch.Tensor, chunks: int, kwargs: dict[str, Any]) -> torch.Tensor:
    """Where whole-model tracing stops: Dynamo cannot trace a backward that calls
    ``torch.autograd.grad``; the chunks call the (regionally compiled) inner layer."""
    return tiled_layer_forward(layer, hidden_states, chunks, **kwargs)


# ---------------------------------------------------------------------------------- the module


class TiledDecoderLayer(StandIn):
    """Stands in for a decoder layer and computes it with :func:`tiled_layer_forward` when
    something is differentiated; otherwise (no grad: eval, generation) it is the layer's own call.

    It shares the original layer's children, parameters and buffers (the same dicts), so the
    model's parameter names and state-dict keys are exactly those of the untiled model. The
    original is kept (unregistered) as ``inner``; :func:`hone.models.structure.decoder_layers`
    finds this wrapper in its place (``stands_in_for_decoder_layer``) and regional compile
    compiles ``inner``.
    """

    stands_in_for_decoder_layer = True

    def __init__(self, layer: nn.Module, chunks: int) -> None:
        super().__init__(layer, chunks, "chunks")
        self.chunks = chunks
        # this wrapper is the layer's checkpoint: a chunk's recompute must not be checkpointed again
        if getattr(layer, "gradient_checkpointing", False):
            layer.gradient_checkpointing = False

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        params = any(p.requires_grad for p in self.inner.parameters())
        if not (torch.is_grad_enabled() and (hidden_states.requires_grad or params)):
            return self.inner(hidden_states, *args, **kwargs)
        if args or hidden_states.dim() != 3:
            raise TiledLayersError(
                f"memory.tiled_layers: {type(self.inner).__name__} was called with "
                + (
                    f"{len(args)} positional arguments beside its input"
                    if args
                    else f"an input of shape {tuple(hidden_states.shape)}"
                )
                + "; tiled layers handle layer(hidden_states [batch, seq, hidden], **keyword arguments). Set "
                "memory.tiled_layers: off for this model"
            )
        return _tiled_boundary(self.inner, hidden_states, self.chunks, kwargs)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}, layer={type(self.inner).__name__}"


def apply_tiled_layers(model: nn.Module, chunks: int) -> dict[str, Any]:
    """Replace every decoder layer of ``model`` (a transformers model or a PEFT wrapper) by a
    :class:`TiledDecoderLayer` of ``chunks`` chunks and switch its attention to
    :data:`~hone.models.attention.tiled.TILED_SDPA`; returns what was done, for
    optimizations.json. Apply after activation checkpointing and before compile. Idempotent."""
    base = unwrap_peft(model)
    config = getattr(base, "config", None)
    if getattr(config, "output_router_logits", False):
        raise TiledLayersError(
            "memory.tiled_layers: the model records its router logits (config.output_router_logits: true) from forward "
            "hooks, which would see each chunk's logits without gradients; set memory.tiled_layers: off"
        )
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", CAUSAL_SDPA, TILED_SDPA):
        raise TiledLayersError(
            f"memory.tiled_layers: the model attends through {implementation!r}; tiled layers need "
            "model.attn_implementation: sdpa (their chunks attend through hone's tiled sdpa)"
        )
    blockers = causal_blockers(config)
    if blockers:
        raise TiledLayersError(
            f"memory.tiled_layers: the model has {', '.join(blockers)}; tiled layers handle layers that attend causally "
            "to the whole row. Set memory.tiled_layers: off for this model"
        )
    layers = decoder_layers(model)
    if not layers:
        raise TiledLayersError(
            f"memory.tiled_layers: found no decoder layers in {type(base).__name__} (no module of a class listed in its "
            "_no_split_modules); set memory.tiled_layers: off"
        )
    if implementation != TILED_SDPA:
        base.set_attn_implementation(register_tiled_sdpa())
    lists = [m for m in base.modules() if isinstance(m, nn.ModuleList)]
    classes: set[str] = set()
    tiled = 0
    for layer in layers:
        if isinstance(layer, TiledDecoderLayer):
            classes.add(type(layer.inner).__name__)
            continue
        owner = next(((ml, i) for ml in lists for i, m in enumerate(ml) if m is layer), None)
        if owner is None:
            raise TiledLayersError(
                f"memory.tiled_layers: {type(layer).__name__} is not held in a ModuleList of {type(base).__name__}; "
                "set memory.tiled_layers: off for this model"
            )
        owner[0][owner[1]] = TiledDecoderLayer(layer, chunks)
        classes.add(type(layer).__name__)
        tiled += 1
    return {"chunks": chunks, "layers": len(layers), "classes": sorted(classes), "newly_tiled": tiled, "attention": TILED_SDPA}


# ---------------------------------------------------------------------------------- the transform


def tiled_layers_blockers(cfg: HoneConfig, device_type: str, strategy: str) -> list[str]:
    """What rules tiled layers out for this run beyond the config's own validators (which refuse
    packing and other backends for an explicit count), on ``device_type`` under the data-parallel
    ``strategy``: the problems of an explicit count, the reason ``auto`` leaves the layers whole."""
    blockers = []
    if cfg.packs_documents:
        blockers.append("packed rows carry a document mask, tiled layers compute causal rows without one")
    if cfg.model.attn_implementation != "sdpa":
        blockers.append(f"model.attn_implementation is {cfg.model.attn_implementation}; tiled layers attend through sdpa")
    if strategy == "fsdp":
        blockers.append(
            "tiled layers are untested under FSDP2 (distributed.strategy resolves to fsdp): use distributed.strategy: ddp"
        )
    if cfg.performance.compiles_on(device_type) and cfg.performance.torch_compile_scope == "model":
        blockers.append(
            "tiled layers need torch_compile_scope: regional (each tiled layer compiles the layer its chunks run; a "
            "whole-model graph would stop at every tiled layer)"
        )
    return blockers


def layers_attend_otherwise(cfg: HoneConfig) -> str | None:
    """Why the model's layers cannot be chunked (sliding windows, sinks, router logits from
    hooks), read from its config; None when they can or the config cannot be read here (the
    transform then says why when it applies)."""
    try:
        config = transformers_config(cfg.model)
    except Exception:  # noqa: BLE001 -- a reason line never fails the plan
        return None
    blockers = list(causal_blockers(config))
    if getattr(config, "output_router_logits", False):
        blockers.append("router logits recorded from hooks")
    return f"the model has {', '.join(blockers)}" if blockers else None


def decide_chunks(
    cfg: HoneConfig, facts: RunFacts, strategy: str, policy: str, mlp_shards: int, param_shards: int
) -> tuple[int, str, bool]:
    """(chunks, why, does_not_fit) of ``memory.tiled_layers`` under the checkpointing ``policy``
    with the MLP in ``mlp_shards``: the configured count, or what ``auto`` decides from the memory
    estimate (:func:`hone.transforms.auto_policy.tiled_layers_choice`). ``auto`` never fails a
    run: where tiled layers cannot apply, or the estimate fails, the layers stay whole."""
    chunks = cfg.memory.tiled_layers_chunks
    if chunks is not None:
        return chunks, f"memory.tiled_layers: {cfg.memory.tiled_layers}", False
    blockers = tiled_layers_blockers(cfg, facts.device.type, strategy)
    if blockers:
        return 0, f"tiled_layers: auto: off, {blockers[0]}", False
    try:
        decision = tiled_layers_choice(
            cfg, facts.device, policy, mlp_shards, facts.memory_bytes,
            host_budget=facts.host_memory_bytes, param_shards=param_shards,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 -- the estimate's failure is reported, not raised
        return 0, f"tiled_layers: auto: off, the memory estimate failed ({type(exc).__name__}: {exc})", False
    blocker = layers_attend_otherwise(cfg) if decision.shards else None
    if blocker is not None:
        return 0, f"tiled_layers: auto: off, {blocker} (tiled layers attend causally to the whole row)", True
    return decision.shards, decision.why, decision.does_not_fit


def _check(ctx: PlanContext) -> list[str]:
    """What the config validators cannot see: ``auto`` decisions and the device."""
    key = f"memory.tiled_layers: {ctx.cfg.memory.tiled_layers}"
    problems = []
    policy = ctx.decided.checkpointing
    if policy not in INPUT_ONLY_POLICIES:
        problems.append(
            f"{key} needs memory.activation_checkpointing full or offload (a tiled layer is the layer's checkpoint), "
            f"but it resolves to {policy}: set activation_checkpointing: full or offload"
        )
    blockers = tiled_layers_blockers(ctx.cfg, ctx.facts.device.type, ctx.decided.strategy)
    return problems + [f"{key}: {b}" for b in blockers]


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    details = apply_tiled_layers(model, ctx.decided.tiled_layers_chunks)
    details["why"] = ctx.decided.tiled_layers_why
    return details


TILED_LAYERS = Transform(
    name="tiled_layers",
    switch="memory.tiled_layers",
    wanted=lambda ctx: ctx.decided.tiled_layers_chunks >= 2,
    why=lambda ctx: ctx.decided.tiled_layers_why,
    check=_check,
    # recorded only when auto left the layers whole on a run that does not fit
    skipped_because=lambda ctx: ctx.decided.tiled_layers_skipped,
    model=_apply,
    label=lambda d: f"tiled layers ({d['chunks']} chunks)",
)
