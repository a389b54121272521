"""sdpa for packed rows that computes each document's causal triangle only (varlen kernel).

With a document mask, sdpa still computes every query of a row against every key of the row
and throws the other documents' scores away; the mask itself is ``B * T * T`` bytes (1 GiB per
row at 32k tokens). torch (>= 2.10) ships ``torch.nn.attention.varlen.varlen_attn``, its
FlashAttention-2 kernel for CUDA in bf16/fp16, which takes the documents' boundaries
(``cu_seqlens``) instead of a mask and never touches the blocks between documents.

hone registers it with transformers as the attention backend :data:`VARLEN_SDPA` (through
``AttentionInterface`` and ``AttentionMaskInterface``; no model code is patched). A packed
``sdpa`` run is switched to it by :func:`hone.models.attention.setup.select_packed_kernel`
when the kernel can run; the user's switch stays ``attn_implementation: sdpa``. The
boundaries travel as the keyword arguments transformers defines for flash varlen attention
(``cu_seq_lens_q`` ...). A call without them (an unpacked or padded batch) is transformers'
own sdpa, unchanged.

:func:`reference_varlen_attention` is the plain-PyTorch definition of the kernel (one sdpa
call per document); it runs wherever the fused kernel cannot (CPU, float32), which is what
the CPU tests check the plumbing with.
"""

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

try:
    from torch.nn.attention.varlen import varlen_attn as _FUSED_KERNEL
except ImportError:  # torch < 2.10
    _FUSED_KERNEL = None

#: The name the backend is registered under with transformers.
VARLEN_SDPA = "hone_sdpa_varlen"
#: The forward keyword of shared-prompt pairs' key order (:func:`tree_boundaries`), which only
#: this backend reads.
TREE_KEYS = "hone_tree_keys"

_HALF = (torch.bfloat16, torch.float16)
# Read once at import, not while a compiled layer is traced: torch 2.10 says is_causal=True,
# later ones window_size=(-1, 0); enable_gqa (grouped key/value heads) is newer still.
_KERNEL_PARAMS = inspect.signature(_FUSED_KERNEL).parameters if _FUSED_KERNEL is not None else {}
_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _KERNEL_PARAMS else {"is_causal": True}
_TAKES_GQA = "enable_gqa" in _KERNEL_PARAMS


#: Per CUDA device index: whether the fused kernel, called without ``enable_gqa`` (torch
#: versions whose wrapper lacks it), takes fewer key/value heads than query heads as
#: FlashAttention-2 itself does (:func:`grouped_heads_native`). Absent: not probed, so
#: :func:`varlen_attention` repeats the key/value heads.
_GROUPED_NATIVE: dict[int | None, bool] = {}


def grouped_heads_native(device: torch.device) -> bool:
    """Whether keys and values with fewer heads than the queries can go to the fused kernel as
    they are, instead of repeated to every query head (four times their bytes, kept for the
    backward, on a model with 4 query heads per key/value head).

    Where torch's wrapper takes ``enable_gqa`` (2.12 and later), yes. Where it does not, the
    wrapper may still pass grouped heads through to FlashAttention-2, which takes them, or it
    may refuse them: one probe per device finds out, eagerly (hone calls it when it picks the
    kernel, before anything is compiled): a small causal varlen call with grouped heads against
    the same with repeated ones, output and all three gradients. An error or a disagreement
    keeps the repeat."""
    if _TAKES_GQA:
        return True
    if _FUSED_KERNEL is None or device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _GROUPED_NATIVE:
        _GROUPED_NATIVE[index] = grouped_heads_agree(torch.device("cuda", index))
    return _GROUPED_NATIVE[index]


def grouped_heads_agree(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """The probe of :func:`grouped_heads_native` on ``device``: two segments, 4 query heads over
    2 key/value heads, bf16; equal within bf16's rounding, or False (an error included)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (torch.randn(96, heads, 64, device=device, dtype=dtype, generator=gen) for heads in (4, 2, 2, 4))
    cu = torch.tensor([0, 40, 96], dtype=torch.int32, device=device)

    def run(repeat: int) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kk, vv = (t.repeat_interleave(repeat, dim=1) for t in leaves[1:])
        out = _FUSED_KERNEL(leaves[0], kk, vv, cu, cu, 56, 56, **_CAUSAL)
        return [out, *torch.autograd.grad(out, leaves, grad)]

    try:
        native, repeated = run(1), run(2)
    except Exception:  # noqa: BLE001 - a wrapper that refuses grouped heads: keep repeating them
        return False
    return all(
        a.shape == b.shape and bool((a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max())
        for a, b in zip(native, repeated, strict=True)
    )


def fused_kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused kernel can compute attention for tensors on ``device`` in ``dtype``."""
    return device.type == "cuda" and dtype in _HALF and _FUSED_KERNEL is not None


def reference_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each segment: [N, Hq, D] x [M, Hkv, D] -> [N, Hq, D]. Query
    segment ``i`` attends to key segment ``i`` (``cu_seqlens_k``; default the query's), its last
    query aligned with its last key, as the flash kernel aligns them (a segment with more keys
    than queries: every query sees the extra keys in front, then its own causal prefix)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.empty_like(query)
    q_bounds = cu_seqlens.tolist()
    k_bounds = q_bounds if cu_seqlens_k is None else cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(q_bounds[:-1], q_bounds[1:]), zip(k_bounds[:-1], k_bounds[1:])):
        if q1 > q0:
            q = query[q0:q1].transpose(0, 1)  # [H, n, D]
            k, v = (t[k0:k1].transpose(0, 1) for t in (key, value))
            # query i sees keys up to i + (keys - queries): bottom-right alignment
            visible = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=query.device).tril(k1 - k0 - (q1 - q0))
            out[q0:q1] = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale).transpose(0, 1)
    return out


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_length: int,
    scale: float | None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_length_k: int | None = None,
) -> torch.Tensor:
    """Per-segment causal attention over flattened tokens [N, H, D] (keys [M, H, D] in their own
    segments ``cu_seqlens_k`` where given, as :func:`reference_varlen_attention` aligns them):
    the fused kernel where it runs, the reference otherwise."""
    if not fused_kernel_runs(query.device, query.dtype):
        return reference_varlen_attention(query, key, value, cu_seqlens, scale, cu_seqlens_k)
    groups = query.shape[1] // key.shape[1]
    extra: dict[str, Any] = dict(_CAUSAL)
    if groups > 1:
        if _TAKES_GQA:
            extra["enable_gqa"] = True
        elif not _GROUPED_NATIVE.get(query.device.index, False):
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    max_k = max_length if max_length_k is None else max_length_k
    return _FUSED_KERNEL(query, key, value, cu_seqlens, cu_k, max_length, max_k, scale=scale, **extra)


def _autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast as autocast would cast sdpa's inputs (a custom op is not on autocast's lists): a
    float32 query from an fp32 norm weight meets bf16 keys under bf16 autocast."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) for t in tensors)


def boundaries_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` over the flattened batch: a segment starts at every row and wherever the
    positions do not go up by one (transformers' own reading of packed ``position_ids``)."""
    batch, width = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    at = torch.nonzero(starts.flatten()).flatten().to(torch.int32)
    return torch.cat([at, at.new_tensor([batch * width])])


def boundaries_only_mask(device: torch.device) -> torch.Tensor:
    """The prepared mask a packed micro-batch hands the model under :data:`VARLEN_SDPA`: a
    0-element 4D tensor meaning "no mask: the boundaries say everything".

    Why not None: with no mask and ``position_ids``, transformers' mask preparation reads the
    positions for packed sequences and tests the result with a Python ``if``, a host sync in every
    forward (on a DPO step, the host waited 16 ms for the policy forward before it could queue the
    reference forward; H200 profile, benchmarks/2026-11-29-h200-dpo.md). A 4D mask is taken as
    prepared and passed to every layer untouched, and this backend ignores it when boundaries
    come with it. Only for this backend: another one would read the empty tensor as a mask."""
    return torch.empty((0, 0, 0, 0), dtype=torch.bool, device=device)


def is_boundaries_only(mask: Any) -> bool:
    """Whether ``mask`` is :func:`boundaries_only_mask`'s "no mask" (any 0-element 4D tensor)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.numel() == 0


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: [B, H, T, D] in, ([B, T, H, D], None) out.

    Boundaries come from ``cu_seq_lens_q`` / ``max_length_q`` (hone's packed micro-batches, with
    :func:`boundaries_only_mask` as their mask), or,
    for a caller that passes packed ``position_ids`` and no mask, from the positions. Anything
    else (a padding mask, a KV cache) is transformers' sdpa. Shared-prompt pairs also pass
    :data:`TREE_KEYS` (:func:`tree_boundaries`): the keys and values are gathered in that order
    and segmented by ``cu_seq_lens_k``.
    """
    cu_seqlens, max_length = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    batch, heads, width, dim = query.shape
    if is_boundaries_only(attention_mask):
        if cu_seqlens is None:
            raise ValueError(
                f"{VARLEN_SDPA}: the layer got the boundaries-only mask but no boundaries (cu_seq_lens_q): "
                "attach them with the mask (MicroBatch.with_attention)"
            )
        attention_mask = None
    if cu_seqlens is None:
        positions = kwargs.get("position_ids")
        if attention_mask is not None or positions is None or key.shape[2] != width or width == 1:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        cu_seqlens, max_length = boundaries_from_positions(positions.expand(batch, -1)), width
    if dropout or kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError(
            f"{VARLEN_SDPA} computes plain causal attention per document; this layer asks for "
            f"dropout {dropout}, sliding_window {kwargs.get('sliding_window')}, softcap {kwargs.get('softcap')}"
        )
    q, k, v = (t.transpose(1, 2).reshape(batch * width, t.shape[1], dim) for t in _autocast_inputs(query, key, value))
    tree_keys = kwargs.get(TREE_KEYS)
    if tree_keys is None:
        out = varlen_attention(q, k, v, cu_seqlens, int(max_length or width), scaling)
    else:
        k, v = k[tree_keys], v[tree_keys]
        max_k = int(kwargs.get("max_length_k") or width)
        out = varlen_attention(q, k, v, cu_seqlens, int(max_length or width), scaling, kwargs["cu_seq_lens_k"], max_k)
    return out.view(batch, width, heads, dim), None


def varlen_sdpa_mask(**kwargs: Any) -> torch.Tensor | None:
    """The mask transformers builds for this backend: none without a padding mask (boundaries
    or positions say everything), else sdpa's mask, always materialised, so the attention
    function never has to tell "no padding" from "no mask given" on its own."""
    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(**{**kwargs, "allow_is_causal_skip": False})


def register_varlen_sdpa() -> str:
    """Make :data:`VARLEN_SDPA` a valid ``attn_implementation`` (idempotent); returns the name."""
    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, varlen_sdpa_mask)
    return VARLEN_SDPA
