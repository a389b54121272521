"""A tiny gpt-oss checkpoint with MXFP4 experts, laid out as openai/gpt-oss-20b ships.

:func:`write_mxfp4_gpt_oss` builds the ``tiny-gpt-oss`` preset with random weights, quantizes
each layer's experts with hone's own quantizer and writes ``config.json`` (with the published
``quantization_config``) and ``model.safetensors``: per layer
``model.layers.N.mlp.experts.{gate_up_proj,down_proj}_{blocks,scales}`` (uint8
``[experts, out, in / 32, 16]`` and ``[experts, out, in / 32]``) and the expert biases
``..._bias``, every other tensor in ``dtype``. Tests import it as ``from mxfp4_checkpoint import
...`` after putting ``tests/`` on ``sys.path`` (as tests/gpu does with tests/kernels)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hone.kernels.mxfp4_dequant import mxfp4_quantize, mxfp4_to_gpt_oss

#: openai/gpt-oss-20b's config.json: the modules MXFP4 leaves alone (everything but the experts).
GPT_OSS_QUANTIZATION_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    "quant_method": "mxfp4",
}
#: The experts' quantized projections (transformers' parameter names).
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")


@dataclass
class Mxfp4Checkpoint:
    """What :func:`write_mxfp4_gpt_oss` wrote: the directory, the config, the random model's
    float32 state dict before quantization (transformers' names and layouts), and each expert
    parameter as the checkpoint holds it once dequantized (float32, transformers' ``[experts,
    in, out]`` layout)."""

    path: Path
    config: object
    weights: dict[str, torch.Tensor]
    experts: dict[str, torch.Tensor]


def write_mxfp4_gpt_oss(
    directory: Path, *, vocab_size: int = 512, seed: int = 0, dtype: torch.dtype = torch.bfloat16, overrides: dict | None = None
) -> Mxfp4Checkpoint:
    """Write the checkpoint into ``directory`` (created) and describe it."""
    from safetensors.torch import save_file
    from transformers import GptOssForCausalLM

    from hone.models.presets import build_preset_config

    config = build_preset_config("tiny-gpt-oss", dict(overrides or {}), vocab_size)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config)
    weights = {name: tensor.detach().float().clone() for name, tensor in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)
    for name in weights:  # transformers initialises the expert biases to zero: make them tell
        if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
            weights[name] = torch.randn(weights[name].shape, generator=gen) * 0.02
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.rsplit(".", 1)[-1] in EXPERT_PROJECTIONS and ".mlp.experts." in name:
            # transformers holds [experts, in, out]; the checkpoint quantizes along `in` as [experts, out, in]
            blocks, scales = mxfp4_quantize(tensor.transpose(-1, -2))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            experts[name] = mxfp4_to_gpt_oss(blocks, scales, torch.float32)
        else:
            tensors[name] = tensor.to(dtype).contiguous()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config.quantization_config = dict(GPT_OSS_QUANTIZATION_CONFIG)
    config.architectures = ["GptOssForCausalLM"]
    config.dtype = dtype
    config.save_pretrained(path)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return Mxfp4Checkpoint(path=path, config=config, weights=weights, experts=experts)


def dequantized_reference(checkpoint: Mxfp4Checkpoint):
    """transformers' GptOss holding the checkpoint's weights, its experts the dequantized values
    (float32, eager attention and experts): what a model loaded from the checkpoint must equal."""
    from transformers import GptOssForCausalLM

    from hone.models.experts import set_experts_implementation

    config = GptOssForCausalLM.config_class.from_dict(
        {k: v for k, v in checkpoint.config.to_dict().items() if k != "quantization_config"}
    )
    config._attn_implementation = "eager"
    model = GptOssForCausalLM(config)
    model.load_state_dict({**checkpoint.weights, **checkpoint.experts})
    set_experts_implementation(model, "eager")
    return model.eval()
