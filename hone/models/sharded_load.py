"""Load a big model for FSDP2 without any rank ever holding the whole of it.

The normal loader (:mod:`hone.models.loader`) builds the model on the device and fills every
weight; on N ranks that is N whole copies before sharding. Here, in order:

1. the base model is built from its config with every *parameter* on the meta device (a
   parameter-registration hook, torch's public ``register_module_parameter_registration_hook``,
   moves each one there as it is created). Buffers stay real: RoPE's ``inv_freq`` is computed
   by the model's own constructor, in float32, exactly as a normal load computes it;
2. the base-stage transforms run (attention kernel), then the adapter is attached. New adapter
   weights (LoRA A/B) are drawn on the CPU from the run's seeded stream, as in a normal load;
   PEFT then moves them next to the base weights (the meta device), so the values are kept as
   they are drawn (the registration hook holds on to each adapter tensor's storage);
3. the caller shards the model (the plan's adapted-stage transforms, FSDP2 last) while it is
   still on the meta device;
4. ``to_empty`` allocates each rank's shards on the device; the buffers are put back; each rank
   reads from the safetensors files only the rows of its shards (``safe_open(...).get_slice``),
   one tensor at a time; the adapter weights are sliced from the values drawn in step 2. A fused
   experts tensor (transformers 5's ``mlp.experts.gate_up_proj``) that the checkpoint keeps as one
   tensor per expert (Hugging Face's qwen3-moe) is assembled from this rank's experts only
   (:mod:`hone.models.expert_keys`); under expert parallelism the experts' blocks, which FSDP2
   leaves local, are the rows of the rank's experts (its ``ExpertShard.first`` onwards).

The result equals a normal load sharded afterwards (a CPU test proves it for LoRA and for a
full fine-tune with tied embeddings). Presets (random weights, no files) load normally.
"""

import math
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hone.config import HoneConfig
from hone.models.adapters import apply_adapter
from hone.models.attention.sinks import sink_backend_for
from hone.models.errors import ModelError
from hone.models.expert_keys import expert_rows, per_expert_sources
from hone.models.experts.mxfp4 import quant_method
from hone.models.experts.parallel import SHARDED_TENSORS, expert_shard
from hone.models.hub import local_model_dir
from hone.models.loader import LoadedModel, check_vocab_fits, count_parameters, describe, seeded
from hone.models.model_dir import check_model_dir, read_causal_lm_config
from hone.models.precision import precision_for
from hone.models.rope_scaling import with_rope_scaling
from hone.models.weight_files import checkpoint_key, parameters_on_meta, weight_files


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's tensor of ``param``, its first row in the whole tensor).

    FSDP2 shards dim 0 as ``torch.chunk`` does: rank ``r`` holds rows ``r * ceil(n / world)``
    onwards (the last ranks may hold fewer, or none)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return param.data, 0
    placements = param.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ModelError(f"sharded load: unexpected placement {placements} (hone shards dim 0 on a 1-D mesh)")
    rows = param.shape[0]
    chunk = math.ceil(rows / param.device_mesh.size())
    return param.to_local(), chunk * param.device_mesh.get_local_rank()


def expert_block_starts(model: nn.Module) -> dict[int, int]:
    """``id(param)`` -> its first row in the whole tensor, for the expert blocks that expert
    parallelism left local (plain tensors FSDP2 does not shard: :func:`local_rows` says 0)."""
    starts = {}
    for module in model.modules():
        shard = expert_shard(module)
        if shard is None:
            continue
        for name, param in module.named_parameters(recurse=False):
            if name in SHARDED_TENSORS:
                starts[id(param)] = shard.first
    return starts


@torch.no_grad()
def fill_from_safetensors(model: nn.Module, path: Path, skip: set[str]) -> None:
    """Copy each rank's rows of every parameter (except ``skip``) from the files in ``path``; a
    fused experts tensor missing from them is assembled from one tensor per expert
    (:mod:`hone.models.expert_keys`), this rank's experts only."""
    from safetensors import safe_open

    files = weight_files(path)
    starts = expert_block_starts(model)
    wanted: dict[Path, list[tuple[str, str, torch.Tensor]]] = {}
    per_expert: list[tuple[str, Callable[[int], list[str]], torch.Tensor]] = []
    for name, param in model.named_parameters():
        if name in skip:
            continue
        key = checkpoint_key(name)
        if key in files:
            wanted.setdefault(files[key], []).append((name, key, param))
            continue
        sources = per_expert_sources(key, files)
        if sources is None:
            raise ModelError(f"model.path: '{path}' has no tensor '{key}' (for the model's '{name}')")
        per_expert.append((key, sources, param))
    for file, entries in wanted.items():
        with safe_open(str(file), framework="pt") as f:
            for _name, key, param in entries:
                local, start = local_rows(param)
                if local.numel() == 0:
                    continue
                start += starts.get(id(param), 0)
                _copy_rows(local, f.get_slice(key)[start : start + local.shape[0]], key, file.name)
    with ExitStack() as stack:
        opened: dict[Path, object] = {}

        def read(key: str) -> torch.Tensor:
            if key not in files:
                raise ModelError(f"model.path: '{path}' has no tensor '{key}' (one expert of a per-expert checkpoint)")
            if files[key] not in opened:
                opened[files[key]] = stack.enter_context(safe_open(str(files[key]), framework="pt"))
            return opened[files[key]].get_tensor(key)

        for key, sources, param in per_expert:
            local, start = local_rows(param)
            if local.numel():
                rows = expert_rows(sources, start + starts.get(id(param), 0), local.shape[0], read)
                _copy_rows(local, rows, key, "its per-expert tensors")


def _copy_rows(local: torch.Tensor, rows: torch.Tensor, key: str, where: str) -> None:
    if tuple(rows.shape) != tuple(local.shape):
        raise ModelError(
            f"model.path: tensor '{key}' in {where} has shape {tuple(rows.shape)} where the model expects {tuple(local.shape)}"
        )
    local.copy_(rows)


@torch.no_grad()
def fill_from_full(params: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Copy each rank's rows of ``params`` (whole tensors, by parameter name) into ``model``."""
    named = dict(model.named_parameters())
    for name, value in params.items():
        local, start = local_rows(named[name])
        if local.numel():
            local.copy_(value[start : start + local.shape[0]])


def load_model_sharded(
    cfg: HoneConfig,
    tokenizer,
    device: torch.device,
    shard: Callable[[nn.Module], object],
    before_adapter: Callable[[nn.Module], object] | None = None,
) -> LoadedModel:
    """The model of ``cfg.model.path``, adapted and sharded by ``shard`` (the plan's
    adapted-stage transforms) before any weight is allocated; each rank reads only its rows.

    ``before_adapter(base)`` runs on the meta-device base model (the plan's base stage)."""
    model_cfg = cfg.model
    if model_cfg.path is None:
        raise ModelError("sharded load: model.path is not set (presets load normally: their weights are drawn, not read)")
    path = local_model_dir(model_cfg.path)  # a hub id: its cached snapshot
    check_model_dir(path)
    precision = precision_for(model_cfg.dtype, full_finetune=not cfg.adapter.is_lora)
    config = with_rope_scaling(read_causal_lm_config(path, model_cfg.trust_remote_code), model_cfg.rope_scaling)
    method = quant_method(config)
    if method is not None:
        raise ModelError(
            f"model.path: '{path}' ships a quantized checkpoint (quantization_config.quant_method '{method}'), "
            "which the sharded load (distributed.strategy: fsdp) does not read: FSDP2 shards plain weights only, and MXFP4 "
            "experts train on one GPU (hone loads them as blocks and scales there). Train it without "
            "distributed.strategy: fsdp, or point model.path at an unquantized checkpoint"
        )
    with parameters_on_meta():
        base = AutoModelForCausalLM.from_config(
            config,
            dtype=precision.weights,
            attn_implementation=sink_backend_for(config, model_cfg.attn_implementation),
            trust_remote_code=model_cfg.trust_remote_code,
        )
    check_vocab_fits(base, tokenizer, model_cfg)
    if before_adapter is not None:
        before_adapter(base)
    drawn: dict[str, torch.Tensor] = {}
    with seeded(seed=cfg.training.seed + 1, device=torch.device("cpu")), parameters_on_meta(keep=drawn):
        model = apply_adapter(base, cfg.adapter)
    adapter_values = _adapter_values(model, drawn, precision.weights, precision.trainable)
    for param in model.parameters():  # the master dtype of trainable weights, still on meta
        if param.requires_grad and param.dtype != precision.trainable and param.is_floating_point():
            param.data = param.data.to(precision.trainable)
    model.train()
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    shard(model)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
    fill_from_safetensors(model, path, skip=set(adapter_values))
    fill_from_full(adapter_values, model)
    trainable, total = count_parameters(model)
    return LoadedModel(model, trainable, total, describe(base, cfg, precision, trainable, total) + " | sharded load", precision)


def _adapter_values(
    model: nn.Module, drawn: dict[str, torch.Tensor], base_dtype: torch.dtype, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Parameter name -> the whole initial value of every weight the adapter created, rounded as
    a normal load rounds it (PEFT moves new adapters to the base layer's dtype before casting
    them to float32)."""
    values = {}
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            found = drawn.get(f"{id(module)}.{name}")
            if found is not None:
                values[f"{module_name}.{name}" if module_name else name] = found.to(base_dtype).to(dtype)
    return values
