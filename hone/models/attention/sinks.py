"""Attention with sinks (gpt_oss), for training: flex attention rescaled by its log-sum-exp.

A model with attention sinks (gpt_oss' per-head ``sinks``, passed to the attention function
as ``s_aux``) adds one logit per head to every query's softmax, a column whose value is zero:

    out = sum_j exp(s_j) v_j / (exp(lse) + exp(sink)) = attn(q, k, v) * sigmoid(lse - sink)

with ``lse`` the log-sum-exp of the query's unmasked scores. So any kernel that returns its
log-sum-exp computes sink attention exactly, gradients included (autograd through ``lse``).

What transformers (5.17-5.24) offers for a model with sinks, and why hone adds a backend:

- ``sdpa``: gpt_oss declares no sdpa support (loading it with sdpa is an error); hone's own
  sdpa variants (:mod:`~hone.models.attention.causal`, :mod:`~hone.models.attention.varlen`)
  would drop ``s_aux`` silently.
- ``flex_attention``: rescales by the lse as above, but after casting the lse to bf16
  (a percent-level error in every output) and refuses the CPU.
- ``flash_attention_2/3``: pass the sinks on only to kernels that take them (vLLM's FA3, FA4);
  the flash-attn package's kernels do not, and transformers then drops them without a word.
- ``eager``: exact, materialises every score matrix.

:data:`SINK_ATTENTION` is hone's backend (``AttentionInterface`` + ``AttentionMaskInterface``,
no patching): on CUDA, compiled flex attention with the lse requested and the rescale in
float32; sliding windows, padding and packed documents come from transformers' own flex
``BlockMask`` (its mask functions combine the window, the padding and the documents read from
restarting ``position_ids``). Elsewhere (CPU, where flex has no backward) the same rescale on
dense scores, so CPU runs train and tests check the gradient of the formula itself.
:func:`sink_backend_for` picks it for any model with sinks before the model is built, and
refuses a backend that would drop the sinks.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask, sdpa_mask

from hone.models.errors import ModelError

#: The name the backend is registered under with transformers.
SINK_ATTENTION = "hone_flex_sinks"
#: transformers model types whose attention takes learned sinks (``s_aux``).
SINK_MODEL_TYPES = ("gpt_oss",)
#: Requested backends hone runs through :data:`SINK_ATTENTION` on a model with sinks.
REPLACED = ("sdpa", "flex_attention")
#: Backends that would compute attention without the sinks (refused).
DROPS_SINKS = ("flash_attention_2", "flash_attention_3")

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch < 2.5
    BlockMask, flex_attention = None, None

# torch >= 2.9 returns the lse through an AuxRequest, older versions through return_lse.
_FLEX_PARAMS = inspect.signature(flex_attention).parameters if flex_attention is not None else {}
if "return_aux" in _FLEX_PARAMS:
    from torch.nn.attention.flex_attention import AuxRequest

    _LSE_KWARGS: dict[str, Any] = {"return_aux": AuxRequest(lse=True)}
else:  # pragma: no cover - torch < 2.9
    _LSE_KWARGS = {"return_lse": True}

_compiled_flex = None


def has_attention_sinks(config: Any) -> bool:
    """Whether a model with ``config`` passes learned sinks to its attention function."""
    return getattr(config, "model_type", None) in SINK_MODEL_TYPES


def sink_backend_for(config: Any, requested: str) -> str:
    """The ``attn_implementation`` to build a model with ``config`` with, given the user's
    ``model.attn_implementation``: :data:`SINK_ATTENTION` for a model with sinks where the
    requested backend is sdpa or flex_attention, the request itself otherwise (eager keeps
    transformers' exact eager attention). ModelError for a backend that would drop the sinks."""
    if not has_attention_sinks(config):
        return requested
    if requested in DROPS_SINKS:
        raise ModelError(
            f"model.attn_implementation: '{requested}' would compute {config.model_type}'s attention "
            "without its attention sinks (the flash-attn kernels take none, and transformers drops "
            "them silently); use sdpa (hone's flex attention with sinks) or eager"
        )
    if requested in REPLACED:
        return register_sink_attention()
    return requested


def _lse_flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any, scale: float | None):
    """flex attention's output and its float32 log-sum-exp: compiled on CUDA (the eager flex is
    an unfused reference that materialises every score), eager elsewhere (forward only)."""
    global _compiled_flex
    fn = flex_attention
    if query.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    out, lse = fn(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=key.shape[1] != query.shape[1], **_LSE_KWARGS)
    return out, getattr(lse, "lse", lse)


def flex_sink_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any, sinks: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Sink attention [B, Hq, T, D] x [B, Hkv, S, D] -> [B, Hq, T, D] through flex attention:
    its output times ``sigmoid(lse - sink)`` in float32 (module docstring)."""
    out, lse = _lse_flex(query, key, value, block_mask, scale)
    keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * keep.unsqueeze(-1)).to(query.dtype)


def dense_sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """The same rescale on dense float32 scores (``mask``: [B, 1, T, S] bool, True = attend):
    differentiable anywhere, the CPU path. A query that sees no key gets zero, as in eager."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    keep = torch.sigmoid(lse - sinks.float().view(1, -1, 1, 1))
    return (torch.matmul(probs, value.float()) * keep).to(query.dtype)


def _autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast as autocast casts a matmul's inputs (flex is on no autocast list): a float32 query
    (LoRA output) meets bf16 keys under bf16 autocast."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) for t in tensors)


def sink_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: [B, H, T, D] in, ([B, T, H, D], None) out.

    ``attention_mask`` is what :func:`sink_attention_mask` built: a flex ``BlockMask`` on CUDA,
    a boolean [B, 1, T, S] mask elsewhere (either may be None: plain causal). The sliding window
    is inside the mask (transformers builds a windowed mask for sliding layers)."""
    if dropout:
        raise ValueError(f"{SINK_ATTENTION} has no attention dropout (the layer asks for {dropout})")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{SINK_ATTENTION} does not soft-cap attention logits (softcap {kwargs['softcap']})")
    if s_aux is None:
        s_aux = torch.full((query.shape[1],), float("-inf"), device=query.device)  # no sink: sigmoid(inf) = 1
    query, key, value = _autocast_inputs(query, key, value)
    if attention_mask is None or (BlockMask is not None and isinstance(attention_mask, BlockMask)):
        # A KV cache (generation) grows the keys every token, which would recompile the
        # compiled flex kernel each time: decoding takes the dense path.
        decoding = query.shape[2] != key.shape[2]
        if attention_mask is None and query.shape[2] > 1:
            attention_mask = _causal_block_mask(query, key)
        if not decoding and (query.device.type == "cuda" or not torch.is_grad_enabled()):
            out = flex_sink_attention(query, key, value, attention_mask, s_aux, scaling)
            return out.transpose(1, 2).contiguous(), None
        attention_mask = None if attention_mask is None else _dense(attention_mask, query, key)
    out = dense_sink_attention(query, key, value, attention_mask, s_aux, scaling)
    return out.transpose(1, 2).contiguous(), None


def _causal_block_mask(query: torch.Tensor, key: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    offset = key.shape[2] - query.shape[2]
    return create_block_mask(lambda b, h, q, kv: q + offset >= kv, None, None, query.shape[2], key.shape[2], device=query.device)


def _dense(block_mask: Any, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_mask

    return create_mask(block_mask.mask_mod, query.shape[0], 1, query.shape[2], key.shape[2], device=query.device)


def sink_attention_mask(**kwargs: Any) -> Any:
    """The mask transformers builds for :data:`SINK_ATTENTION`: its flex ``BlockMask`` on CUDA,
    its boolean sdpa mask (always materialised) elsewhere. The keyword arguments go through as
    transformers passes them (``device`` in 5.x; older releases pass ``cache_position``)."""
    where = kwargs.get("device")
    if where is None:
        where = getattr(kwargs.get("cache_position"), "device", None) or getattr(kwargs.get("attention_mask"), "device", "cpu")
    if torch.device(where).type == "cuda":
        return flex_attention_mask(**kwargs)
    return sdpa_mask(**{**kwargs, "allow_is_causal_skip": False})


def register_sink_attention() -> str:
    """Make :data:`SINK_ATTENTION` a valid ``attn_implementation`` (idempotent); returns the name."""
    AttentionInterface.register(SINK_ATTENTION, sink_attention)
    AttentionMaskInterface.register(SINK_ATTENTION, sink_attention_mask)
    return SINK_ATTENTION
