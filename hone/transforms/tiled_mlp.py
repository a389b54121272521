"""Tiled MLP: each decoder layer's MLP computed in shards of tokens, under recomputation.

Why: at long context the largest tensors of a decoder layer are the MLP's
``[tokens x intermediate]`` activations (SwiGLU's gate, up and their product: for qwen3-8b at
64K tokens, 1.5 GiB each in bf16), alive all at once in the forward and again in the recompute
of a checkpointed layer. Token-wise modules (a dense MLP, an MoE block: every token is routed and
transformed on its own) give the same result computed shard by shard, so those tensors never
need to exist for more than ``tokens / shards`` tokens at a time.

How (the idea of ALST's TiledMLP, written for hone):

- :class:`TiledMLP` takes the place of the decoder layer's MLP *instance* (``layer.mlp``) and
  shares the original's children and parameters (the same ``_modules``/``_parameters`` dicts), so
  every parameter keeps its name: state dicts, PEFT adapter files, checkpoints and FSDP see the
  same keys as without tiling. transformers' classes are not touched.
- :class:`_TiledMLPFunction` (a ``torch.autograd.Function``) runs the original module on each
  shard under ``no_grad`` and keeps only its input. Its backward recomputes one shard at a time
  with grad enabled and differentiates it with ``torch.autograd.grad`` (which writes no
  ``.grad``), sums the parameter gradients over the shards in float32, and *returns* them: the
  trainable parameters are inputs of the Function, so each one's gradient reaches its
  ``AccumulateGrad`` node exactly once per backward, through the outer graph, like any other
  op's. No hook is registered and nothing is left behind; FSDP2's post-backward reduction sees
  one gradient per parameter, as from an untiled MLP.
- The recompute restores the forward's autocast state and, when the MLP holds a dropout (LoRA
  dropout), its RNG state, so it recomputes exactly what the forward computed.

Composition: activation checkpointing recomputes the whole layer in the backward, and with it
this Function's forward (under ``no_grad``, saving the input again): the checkpoint's hooks hold
the saved input, the Function's backward then recomputes the shards as above. Selective
checkpointing caches nothing computed under ``no_grad`` (see
:func:`hone.transforms.checkpointing.selective_policy`). Dynamo cannot trace a backward that calls
``torch.autograd.grad``, so the Function is a graph boundary for ``torch.compile``
(``torch.compiler.disable`` on :meth:`TiledMLP.forward`): a compiled layer is two graphs (before
and after the MLP) around the eager, tiled MLP.

Cost: one extra MLP forward per layer in the backward (the same as checkpointing the MLP),
on top of a checkpointed layer's own recompute.

As a transform (:data:`TILED_MLP`) it runs on the adapted model (it takes the PEFT-wrapped
projections as they are), with the shard count the plan decided (``memory.tiled_mlp``; ``auto``
tiles only when the memory estimate says the MLP's activations are what does not fit).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hone.errors import HoneError
from hone.models.structure import decoder_layers
from hone.transforms.base import PlanContext, Transform
from hone.transforms.recompute import GradSums, Replay, has_dropout
from hone.transforms.stand_in import StandIn

__all__ = ["TILED_MLP", "TiledMLP", "TiledMLPError", "apply_tiled_mlp", "shard_sizes", "tiled_mlp_forward"]


class TiledMLPError(HoneError):
    """The model's MLP cannot be tiled the way the config asks."""


# ---------------------------------------------------------------------------------- shards


def shard_sizes(tokens: int, shards: int) -> list[int]:
    """Shard lengths: ``ceil(tokens / shards)`` each, the last one shorter (uneven) when the
    tokens do not divide; fewer shards than asked when there are fewer tokens than that."""
    size = max(1, math.ceil(tokens / shards))
    sizes = [size] * (tokens // size)
    if tokens % size:
        sizes.append(tokens % size)
    return sizes


def _flat_tokens(x: torch.Tensor) -> torch.Tensor:
    """``x [..., hidden]`` as ``[tokens, hidden]`` (micro-batch rows laid end to end)."""
    return x.reshape(-1, x.shape[-1])


def _shard_input(piece: torch.Tensor, ndim: int) -> torch.Tensor:
    """One shard of ``n`` tokens shaped as the module expects its input: ``[1, n, hidden]`` for a
    ``[batch, seq, hidden]`` input (one row of ``n`` tokens), ``[n, hidden]`` for a flat one."""
    return piece.reshape((1,) * (ndim - 2) + piece.shape)


def _as_tuple(out: Any) -> tuple[tuple[torch.Tensor | None, ...], bool]:
    """The module's output as a tuple of tensors (or None), and whether it was a tuple."""
    if isinstance(out, torch.Tensor):
        return (out,), False
    if isinstance(out, (tuple, list)) and all(o is None or isinstance(o, torch.Tensor) for o in out):
        return tuple(out), True
    raise TiledMLPError(
        f"memory.tiled_mlp: the MLP returned {type(out).__name__}; tiling handles a tensor or a tuple of "
        "tensors (e.g. an MoE block's output and router logits). Set memory.tiled_mlp: off for this model"
    )


def _token_rows(out: torch.Tensor, n: int, ndim: int, index: int) -> torch.Tensor:
    """One shard's output ``out`` as ``[n, ...]``: either shaped like the shard's input
    (``[1, n, ...]``) or flat over its tokens (``[n, ...]``, e.g. router logits)."""
    if _input_shaped(out, n, ndim):
        return out.reshape((n,) + tuple(out.shape[ndim - 1 :]))
    if out.dim() >= 1 and out.shape[0] == n:
        return out
    raise TiledMLPError(
        f"memory.tiled_mlp: output {index} of the MLP has shape {tuple(out.shape)} for a shard of {n} tokens: "
        "it is not one row per token, so shards cannot be put back together (the module mixes tokens). "
        "Set memory.tiled_mlp: off for this model"
    )


# ---------------------------------------------------------------------------------- autograd


class _Spec:
    """What the forward found out about the module's output, for the caller to rebuild it:
    whether it was a tuple, and where it held None (the Function returns only tensors)."""

    is_tuple: bool = False
    present: tuple[int, ...] = ()
    length: int = 1


class _TiledMLPFunction(torch.autograd.Function):
    """``module(x)`` computed shard by shard; see the module docstring.

    ``apply(module, shards, spec, x, *params)``: ``params`` are the module's parameters that
    require grad, passed as inputs so that their gradients leave through the normal autograd
    path. Returns the module's tensor outputs, each put back to full length (``spec`` says where
    they go in the module's own output).
    """

    @staticmethod
    def forward(
        ctx: Any, module: nn.Module, shards: int, spec: _Spec, x: torch.Tensor, *params: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.module, ctx.ndim, ctx.n_params = module, x.dim(), len(params)
        ctx.recompute = Replay(x, has_dropout(module))
        ctx.recompute.capture()  # the shards run in order from one RNG state, and are replayed so
        flat = _flat_tokens(x)
        ctx.sizes = shard_sizes(flat.shape[0], shards)
        buffers: list[torch.Tensor] = []
        at = 0
        with torch.no_grad():
            for i, piece in enumerate(flat.split(ctx.sizes)):
                n = piece.shape[0]
                outs, is_tuple = _as_tuple(module(_shard_input(piece, ctx.ndim)))
                if i == 0:
                    spec.is_tuple, spec.length = is_tuple, len(outs)
                    spec.present = tuple(k for k, o in enumerate(outs) if o is not None)
                    ctx.shaped = [_input_shaped(outs[k], n, ctx.ndim) for k in spec.present]
                rows = [_token_rows(outs[k], n, ctx.ndim, k) for k in spec.present]
                if i == 0:
                    buffers = [r.new_empty((flat.shape[0],) + tuple(r.shape[1:])) for r in rows]
                for buffer, r in zip(buffers, rows):
                    buffer[at : at + n].copy_(r)
                at += n
        ctx.present = spec.present
        ctx.save_for_backward(x)
        lead = tuple(x.shape[:-1])
        results = tuple(b.view(lead + tuple(b.shape[1:])) if shaped else b for b, shaped in zip(buffers, ctx.shaped))
        ctx.mark_non_differentiable(*(r for r in results if not r.is_floating_point()))
        return results

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        module: nn.Module = ctx.module
        wants_x = ctx.needs_input_grad[3]
        params = [p for p in module.parameters() if p.requires_grad]
        if len(params) != ctx.n_params:
            raise RuntimeError(f"tiled MLP: {len(params)} trainable parameters in the backward, {ctx.n_params} in the forward")
        wanted = [ctx.needs_input_grad[4 + i] for i in range(len(params))]
        # each output's gradient as [tokens, ...], to slice per shard
        flat_grads = [
            None if g is None else g.reshape((-1,) + tuple(g.shape[ctx.ndim - 1 :] if shaped else g.shape[1:]))
            for g, shaped in zip(grads, ctx.shaped)
        ]
        flat_x = _flat_tokens(x)
        x_grad = torch.empty_like(flat_x) if wants_x else None
        sums = GradSums(len(params))
        at = 0
        with ctx.recompute.context(0, grad=True):
            for piece in flat_x.split(ctx.sizes):
                n = piece.shape[0]
                shard = _shard_input(piece.detach(), ctx.ndim).requires_grad_(wants_x)
                outs, _ = _as_tuple(module(shard))
                pairs = [
                    (outs[k], g[at : at + n].reshape(outs[k].shape))
                    for k, g in zip(ctx.present, flat_grads)
                    if g is not None and outs[k].requires_grad
                ]
                inputs = ([shard] if wants_x else []) + [p for p, w in zip(params, wanted) if w]
                got: list[torch.Tensor | None] = [None] * len(inputs)
                if pairs and inputs:
                    got = list(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True))
                if wants_x:
                    shard_grad = got.pop(0)
                    if shard_grad is None:
                        x_grad[at : at + n].zero_()
                    else:
                        x_grad[at : at + n].copy_(shard_grad.reshape(n, -1))
                for i in (i for i, w in enumerate(wanted) if w):
                    sums.add(i, got.pop(0))
                del outs, pairs, got
                at += n
        return (None, None, None, None if x_grad is None else x_grad.view_as(x), *sums.result(params))


def _input_shaped(out: torch.Tensor, n: int, ndim: int) -> bool:
    """Whether a shard's output is laid out like its input (``[1, n, ...]``), not flat."""
    lead = (1,) * (ndim - 2) + (n,)
    return out.dim() >= len(lead) and tuple(out.shape[: len(lead)]) == lead


def tiled_mlp_forward(module: nn.Module, x: torch.Tensor, shards: int) -> Any:
    """``module(x)`` computed in ``shards`` shards of tokens (same output, same gradients),
    holding only ``tokens / shards`` tokens of the module's intermediate activations at a time.
    Without anything to differentiate (eval, generation) it is one plain call."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not (torch.is_grad_enabled() and (x.requires_grad or params)) or x.dim() < 2 or x.numel() == 0:
        return module(x)
    spec = _Spec()
    tensors = _TiledMLPFunction.apply(module, shards, spec, x, *params)
    if not spec.is_tuple:
        return tensors[0]
    out: list[torch.Tensor | None] = [None] * spec.length
    for k, t in zip(spec.present, tensors):
        out[k] = t
    return tuple(out)


# ---------------------------------------------------------------------------------- the module


class TiledMLP(StandIn):
    """Stands in for a decoder layer's MLP and computes it with :func:`tiled_mlp_forward`.

    It shares the original module's children, parameters and buffers (the same dicts), so the
    model's parameter names and state-dict keys are exactly those of the untiled model, and a
    PEFT-wrapped projection inside stays the one the adapter trains. The original module is
    kept (unregistered) and called for each shard, with its own forward and hooks.
    """

    def __init__(self, mlp: nn.Module, shards: int) -> None:
        super().__init__(mlp, shards, "shards")
        self.shards = shards

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or hidden_states.dim() < 2:
            raise TiledMLPError(
                f"memory.tiled_mlp: {type(self.inner).__name__} was called with more than its input; tiling handles "
                "an MLP called as mlp(hidden_states). Set memory.tiled_mlp: off for this model"
            )
        return _tiled_boundary(self.inner, hidden_states, self.shards)

    def extra_repr(self) -> str:
        return f"shards={self.shards}, module={type(self.inner).__name__}"


@torch.compiler.disable
def _tiled_boundary(module: nn.Module, x: torch.Tensor, shards: int) -> Any:
    """Where a compiled layer stops tracing: Dynamo cannot trace a backward that calls
    ``torch.autograd.grad``, so the tiled MLP runs eagerly between the layer's two graphs."""
    return tiled_mlp_forward(module, x, shards)


#: Attribute names of the MLP (dense or MoE block) in transformers' decoder layers.
MLP_NAMES: tuple[str, ...] = ("mlp", "block_sparse_moe", "feed_forward")


def apply_tiled_mlp(model: nn.Module, shards: int) -> dict[str, Any]:
    """Replace the MLP of every decoder layer of ``model`` (a transformers model or a PEFT
    wrapper) by a :class:`TiledMLP` of ``shards`` shards; returns what was done, for
    optimizations.json. Idempotent: an already tiled MLP is left as it is."""
    layers = decoder_layers(model)
    if not layers:
        raise TiledMLPError(
            f"memory.tiled_mlp: found no decoder layers in {type(model).__name__} (no module of a class listed in "
            "its _no_split_modules); set memory.tiled_mlp: off"
        )
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise TiledMLPError(
            "memory.tiled_mlp: the model records its router logits (config.output_router_logits: true) from forward "
            "hooks, which would see each shard's logits without gradients; set memory.tiled_mlp: off"
        )
    classes: set[str] = set()
    tiled = 0
    for layer in layers:
        name = next((n for n in MLP_NAMES if isinstance(getattr(layer, n, None), nn.Module)), None)
        if name is None:
            raise TiledMLPError(
                f"memory.tiled_mlp: {type(layer).__name__} has no MLP under any of the names {', '.join(MLP_NAMES)}; "
                "set memory.tiled_mlp: off"
            )
        mlp = getattr(layer, name)
        if isinstance(mlp, TiledMLP):
            classes.add(type(mlp.inner).__name__)
            continue
        classes.add(type(mlp).__name__)
        setattr(layer, name, TiledMLP(mlp, shards))
        tiled += 1
    return {"shards": shards, "layers": len(layers), "mlp_classes": sorted(classes), "newly_tiled": tiled}


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    details = apply_tiled_mlp(model, ctx.decided.tiled_mlp_shards)
    details["why"] = ctx.decided.tiled_mlp_why
    return details


TILED_MLP = Transform(
    name="tiled_mlp",
    switch="memory.tiled_mlp",
    wanted=lambda ctx: ctx.decided.tiled_mlp_shards > 0,
    why=lambda ctx: ctx.decided.tiled_mlp_why,
    # recorded only when auto left tiling off on a run that does not fit (a run that fits
    # untiled is no news; hone plan prints it through why)
    skipped_because=lambda ctx: ctx.decided.tiled_mlp_skipped,
    model=_apply,
    label=lambda d: f"tiled MLP ({d['shards']} shards)",
)
