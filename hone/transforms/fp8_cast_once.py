"""FSDP2's float8 all-gather with each weight shard cast to float8 once per optimizer step.

torchao's float8 all-gather (``WeightWithDynamicFloat8CastTensor``) casts a weight's bf16 shard
to float8 inside FSDP2's pre-all-gather hook: four eager kernels per weight (to float32, scale,
saturate, to float8), and twice per step, because FSDP2 gathers each layer again for the backward
(reshard after forward). On llama3.2-3b under FSDP2 on 2 H200s that was 392 casts a step, ~50 ms
of device time in a 341 ms step, plus the host time of issuing 1,568 small kernels between the
layers. The shard only changes when the optimizer steps, so the cast is done then, once, for all
weights in one eager call, and the hook hands the cached bits over. (Compiled, the one call
measured the same step time on 2 H200, 342.3 against 342.2 ms, and cost 20 s more at the first
step; a compiled call per weight spent ~50 ms a step of host time in 196 calls' guards.)

Exact: the cached bits are what the hook would compute (the same precomputed scale, the same
float32 multiply, saturation and rounding). The bits are valid exactly as long as torchao's
precomputed scale is, and are checked the same way: they are handed over only with the scale they
were cast with (each optimizer step's precomputation replaces every scale, and casts again), and
only while the shard's storage has not been written from outside (a checkpoint loaded into it
moves its version counter; updates through FSDP2's DTensor do not, which is why the scale is the
key). Otherwise the hook falls back to torchao's own cast. The cache costs one byte per element
of the shard.

A subclass of torchao's weight wrapper rather than a change to it: FSDP2 asks the shard itself
for ``fsdp_pre_all_gather``, so the weights :func:`use_cast_once` rewraps (before FSDP2 shards
them) carry this behaviour and nothing else in the process does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor


def float8_bits(shard: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's cast of a weight with a precomputed tensorwise scale (``hp_tensor_and_scale_to_float8``):
    the multiply in float32, then saturation to the float8 range, then rounding to ``dtype``."""
    top = torch.finfo(dtype).max
    return (shard.to(torch.float32) * scale).clamp(min=-top, max=top).to(dtype)


def cast_all(shards: list[torch.Tensor], scales: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every shard cast with its scale (``scales[i]``), after the optimizer step: four small
    kernels a weight issued back to back while the host has nothing else to do, once a step."""
    return [float8_bits(shard, scales[i], dtype) for i, shard in enumerate(shards)]


@dataclass(frozen=True)
class _Cast:
    bits: torch.Tensor
    scale: torch.Tensor
    version: int


class Float8CastOnceWeight(WeightWithDynamicFloat8CastTensor):
    """torchao's float8-all-gather weight wrapper whose pre-all-gather hook reuses the bits
    :func:`cast_shards` cast after the last optimizer step."""

    def __init__(self, tensor, linear_mm_config, dtype, precomputed_scale=None):
        super().__init__(tensor, linear_mm_config, dtype, precomputed_scale)
        self._cast: _Cast | None = None

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        # torchao's dispatch rewraps what FSDP2's padding, views and copies return in its own
        # class; rewrap those in this one, so a shard FSDP2 builds keeps this hook.
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if isinstance(out, torch.Tensor):  # most ops: one tensor, no tree to walk (host time a dispatch)
            return _as_cast_once(out) if type(out) is WeightWithDynamicFloat8CastTensor else out
        return pytree.tree_map_only(WeightWithDynamicFloat8CastTensor, _as_cast_once, out)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        return Float8CastOnceWeight(
            inner_tensors["_tensor"],
            flatten_spec["mm_config"],
            flatten_spec["dtype"],
            inner_tensors.get("_precomputed_scale"),
        )

    def __getstate__(self) -> dict[str, Any]:
        # a pickled shard leaves its cast behind: derived bits, and float8 (not every reader has it)
        return {**self.__dict__, "_cast": None}

    def __repr__(self) -> str:
        return f"Float8CastOnceWeight(tensor={self._tensor}, dtype={self._dtype}, cached={self._cast is not None})"

    def fsdp_pre_all_gather(self, mesh):
        cast = self._cast
        if cast is not None and cast.scale is self._precomputed_scale and cast.version == self._tensor._version:
            return (cast.bits,), (cast.scale,)
        return super().fsdp_pre_all_gather(mesh)

    def keep_cast(self, bits: torch.Tensor | None) -> None:
        """Keep ``bits``, the shard as it is now cast with its precomputed scale (None: forget the last)."""
        scale = self._precomputed_scale
        self._cast = None if bits is None or scale is None else _Cast(bits, scale, self._tensor._version)


def _as_cast_once(t: WeightWithDynamicFloat8CastTensor) -> Float8CastOnceWeight:
    if isinstance(t, Float8CastOnceWeight):
        return t
    return Float8CastOnceWeight(t._tensor, t._linear_mm_config, t._dtype)


torch.serialization.add_safe_globals([Float8CastOnceWeight])


def use_cast_once(model: nn.Module) -> int:
    """Rewrap every float8-all-gather weight of ``model`` (torchao's wrapper, before FSDP2 shards
    it) as :class:`Float8CastOnceWeight`; returns how many."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, Float8Linear) and type(weight) is WeightWithDynamicFloat8CastTensor:
            wrapped = Float8CastOnceWeight(weight._tensor, weight._linear_mm_config, weight._dtype)
            module.weight = nn.Parameter(wrapped, requires_grad=weight.requires_grad)
            count += 1
    return count


def _shard(weight: Any) -> Float8CastOnceWeight | None:
    local = getattr(weight, "_local_tensor", None)
    return local if isinstance(local, Float8CastOnceWeight) else None


def cast_shards(model: nn.Module) -> int:
    """After the scales are precomputed (:func:`hone.transforms.fp8.precompute_scales`): cast
    every sharded float8-all-gather weight once, in one :func:`cast_all` per float8 dtype;
    returns how many were cast."""
    shards = [s for m in model.modules() if isinstance(m, Float8Linear) and (s := _shard(m.weight)) is not None]
    for shard in shards:
        shard.keep_cast(None)
    scaled = [s for s in shards if s._precomputed_scale is not None]
    for dtype in {s._dtype for s in scaled}:
        group = [s for s in scaled if s._dtype == dtype]
        scales = torch.stack([s._precomputed_scale for s in group])
        with torch.no_grad():
            bits = cast_all([s._tensor for s in group], scales, dtype)
        for shard, b in zip(group, bits, strict=True):
            shard.keep_cast(b)
    return len(scaled)
