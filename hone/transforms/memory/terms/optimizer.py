"""What the optimizer step holds beyond the moments (``optimizer.name: adamw_8bit`` / ``adamw_4bit``).

torchao's low-bit AdamW updates one parameter at a time with a compiled function that
dequantizes the parameter's moments to float32, updates them and quantizes them back; while it
runs, the float32 temporaries of that one tensor are alive. Measured on an H100 (torch 2.11,
torchao 0.18), one step over a 128256 x 3072 bf16 embedding with its moments in place: 8.0
bytes a weight at 8 bits, 24.1 at 4 bits (the 4-bit update keeps more temporaries). The peak of
the whole step is therefore the resident state plus this transient of the largest trainable
tensor: for a full fine-tune of a 128K-vocabulary model, the embedding or the output head.
``torch.optim.AdamW`` (foreach or fused) updates in place and adds nothing measurable.
"""

from hone.config.root import HoneConfig
from hone.transforms.memory.facts import ModelFacts

#: Bytes per weight of the largest trainable tensor that the low-bit step holds while updating it.
STEP_TRANSIENT_BYTES_PER_WEIGHT = {"adamw_8bit": 8, "adamw_4bit": 24}


def largest_trainable_weights(m: ModelFacts) -> int:
    """Weights of the largest trainable tensor: the embedding or head when trained, a trained
    linear of a decoder layer, or a trained MoE layer's stacked gate/up experts tensor."""
    sizes = [0]
    if m.embedding_trainable or m.head_trainable:
        sizes.append(m.vocab * m.hidden)
    for layer in m.layers:
        sizes.extend(linear.in_features * linear.out_features for linear in layer.linears if linear.trainable)
        if layer.moe and layer.experts_trainable:
            sizes.append(m.experts * 2 * m.expert_intermediate * m.hidden)
    return max(sizes)


def optimizer_step_transient(cfg: HoneConfig, m: ModelFacts, param_shards: int) -> int:
    """Bytes the optimizer step adds to the resident state at its peak (FSDP2: each rank updates
    its own shard of the tensor)."""
    per_weight = STEP_TRANSIENT_BYTES_PER_WEIGHT.get(cfg.optimizer.name, 0)
    return per_weight * largest_trainable_weights(m) // max(1, param_shards)
