"""The FLOP model behind MFU, shared by hone and the reference so both rows use one formula.

Per trained token:
  LoRA      4 * N_active + 6 * L * s * d_attn   (forward 2N, input gradients 2N; frozen weights
                                                 get no weight gradients; adapter FLOPs ignored)
  full FT   6 * N_active + 6 * L * s * d_attn   (plus weight gradients 2N)
N_active counts the matmul parameters a token passes through: the input embedding is a gather
and is excluded, the output projection is included (also when tied to the embedding), and for
MoE only the ``num_experts_per_tok`` routed experts of each layer count. Causal attention costs
2 * L * s * d_attn per token forward (QK^T and PV over half the sequence on average, two FLOPs
per multiply-add), twice that backward. Recomputation by checkpointing is not counted: this is
model FLOP utilisation, not hardware FLOP utilisation. A preference objective with a reference
(DPO, IPO) adds the reference's forward, 2 * N_active + 2 * L * s * d_attn, for every token of
both sequences of a pair.
"""

from typing import Any


def active_matmul_params(config: Any, total_params: int) -> int:
    """N_active from a transformers config and the model's total parameter count."""
    hidden = config.hidden_size
    vocab = config.vocab_size
    n = total_params - vocab * hidden  # input embedding
    if getattr(config, "tie_word_embeddings", False):
        n += vocab * hidden  # the tied output projection is still a matmul
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    if experts:
        # qwen3-moe / olmoe name the expert width moe_intermediate_size; gpt-oss and mixtral intermediate_size
        per_expert = 3 * hidden * (getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
        routed = config.num_experts_per_tok
        moe_layers = _moe_layer_count(config)
        n -= moe_layers * (experts - routed) * per_expert
    return n


def _moe_layer_count(config: Any) -> int:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", []) or [])
    return sum(1 for i in range(config.num_hidden_layers) if (i + 1) % step == 0 and i not in dense)


def flops_per_token(config: Any, total_params: int, seq_len: int, full_finetune: bool, reference_forward: bool = False) -> float:
    """Model FLOPs for one trained token at sequence length ``seq_len``; ``reference_forward``:
    plus a forward of a reference model over the same token (DPO, IPO: 2N + 2 * L * s * d_attn)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    d_attn = config.num_attention_heads * head_dim
    n_active = active_matmul_params(config, total_params)
    extra = 2 * n_active + 2 * config.num_hidden_layers * seq_len * d_attn if reference_forward else 0
    return (6 if full_finetune else 4) * n_active + 6 * config.num_hidden_layers * seq_len * d_attn + extra


def mfu(
    config: Any,
    total_params: int,
    seq_len: int,
    full_finetune: bool,
    tokens_per_s: float,
    peak_tflops: float,
    reference_forward: bool = False,
) -> float:
    """Model FLOP utilisation as a fraction of ``peak_tflops``."""
    per_token = flops_per_token(config, total_params, seq_len, full_finetune, reference_forward)
    return per_token * tokens_per_s / (peak_tflops * 1e12)
