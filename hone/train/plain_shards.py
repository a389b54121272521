"""Checkpoint shards as plain tensors, whatever wrapper a transform put around a weight.

torchao's float8 training under FSDP2 keeps each sharded weight as a DTensor whose local shard is
a wrapper subclass (``WeightWithDynamicFloat8CastTensor``): the same bfloat16 values, with the
behaviour that casts them to float8 before the all-gather. Distributed Checkpoint pickles what it
is handed, so such a shard would be written as torchao's class: a checkpoint that only loads
where torchao imports (and not under ``torch.load(weights_only=True)``), for weights that are
plain bfloat16. DCP is handed the plain tensor inside instead: the same storage, so a load in
place still lands in the parameter.

Only a wrapper is unwrapped: a subclass with one inner tensor of its own shape and dtype. A
subclass that encodes its values differently (torchao's 4- or 8-bit optimizer states: codes and
scales of other shapes) is left as it is; its checkpoint is its own format by design.
"""

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _wrapped(local: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor a wrapper subclass holds, or None where ``local`` is not such a wrapper."""
    if type(local) is torch.Tensor or not hasattr(local, "__tensor_flatten__"):
        return None
    names, _ = local.__tensor_flatten__()
    inner = [getattr(local, name) for name in names]
    if len(inner) != 1 or type(inner[0]) is not torch.Tensor:
        return None
    if inner[0].shape != local.shape or inner[0].dtype != local.dtype:
        return None
    return inner[0]


def plain_shard(value: Any) -> Any:
    """``value``, or a DTensor over the same storage whose local shard is a plain tensor."""
    if not isinstance(value, DTensor):
        return value
    local = value.to_local()
    inner = _wrapped(local)
    if inner is None:
        return value
    with torch.no_grad():
        return DTensor.from_local(
            inner.detach(), value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )


def plain_shards(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict (nested dicts and lists of tensors) with every wrapped shard unwrapped."""
    if isinstance(state, dict):
        return {key: plain_shards(value) for key, value in state.items()}
    if isinstance(state, list):
        return [plain_shards(value) for value in state]
    return plain_shard(state)
