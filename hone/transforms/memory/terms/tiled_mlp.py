"""The tiled MLP (``memory.tiled_mlp``): the MLP keeps only its input; while the backward
differentiates one shard it holds that shard's activations and their gradients, the input
gradient and, for weights trained in bf16, float32 sums of the MLP's gradients
(:func:`tiled_mlp_transient`). ``auto``'s rule is :func:`hone.transforms.memory.decide.decide_tiled_mlp`;
its shard count :func:`auto_tiled_shards`.
"""

from typing import Literal

from hone.transforms.memory.facts import LayerFacts, ModelFacts
from hone.transforms.memory.layers import (
    MLP_SITES,
    mlp_backward_bytes_per_token,
    mlp_bytes_per_token,
)
from hone.transforms.memory.step import Step


def auto_tiled_shards(tokens: int, hidden: int) -> int:
    """``memory.tiled_mlp: auto``'s shard count: about ``hidden`` tokens per shard (as ALST
    does), so one shard's ``[tokens x intermediate]`` activations are the size of an MLP weight
    and the shard's matmuls are still large; at least 2."""
    return max(2, -(-tokens // max(hidden, 1)))


def mlp_shards(asked: int | Literal["auto"], tokens: int, hidden: int) -> int:
    """The shards an MLP of ``tokens`` at a time is tiled in: ``asked``, or :func:`auto_tiled_shards`
    for ``auto``; 0 (untiled) below 2."""
    shards = auto_tiled_shards(tokens, hidden) if asked == "auto" else int(asked)
    return shards if shards >= 2 else 0


def tiled_mlp_transient(
    layer: LayerFacts, m: ModelFacts, tokens: int, shards: int, *, compiled: bool, attention: str, device: str
) -> int:
    """Bytes the tiled MLP holds while it differentiates one shard in the backward: the shard's
    activations (what the untiled MLP keeps, for ``tokens / shards`` tokens) and as much again
    for their gradients, the input gradient it fills ([tokens x hidden]) and, for parameters
    trained in a lower precision, their float32 gradient sums."""
    c = m.compute_bytes
    shard_tokens = -(-tokens // shards)
    # the MLP's own saved tensors (eager: the input copy included) for one shard, twice
    per_token = mlp_bytes_per_token(layer, m, compiled=False, attention=attention, device=device) + c * m.hidden
    sums = 0
    if m.trainable_elem_bytes != 4:
        trained = sum(lf.in_features * lf.out_features for lf in layer.linears if lf.trainable and lf.site in MLP_SITES)
        lora = [lf for lf in layer.linears if lf.lora_rank and lf.site in MLP_SITES]
        trained += sum(lf.lora_rank * (lf.in_features + lf.out_features) for lf in lora)
        if layer.experts_trainable:
            trained += m.experts * 3 * m.expert_intermediate * m.hidden
        sums = 4 * trained
    return 2 * per_token * shard_tokens + c * tokens * m.hidden + sums


def mlp_backward_transient(m: ModelFacts, step: Step) -> int:
    """The term: what an MLP's backward holds beside what its layer saved, at its largest layer.
    Tiled, while it differentiates one shard (:func:`tiled_mlp_transient`); untiled, the gradient
    of its intermediate activation (:func:`~hone.transforms.memory.layers.mlp_backward_bytes_per_token`)."""
    if step.tiled:
        kwargs = {"compiled": step.compiled, "attention": step.attention, "device": step.device}
        return max(tiled_mlp_transient(layer, m, step.piece, step.shards, **kwargs) for layer in m.distinct_layers)
    return max(mlp_backward_bytes_per_token(layer, m) for layer in m.distinct_layers) * step.piece
