"""Load a checkpoint whose experts ship in MXFP4 (gpt-oss as published), keeping them in MXFP4.

transformers' own MXFP4 path needs kernels fetched from a hub at run time, else it dequantizes
every expert to bf16 (gpt-oss-120b: ~230 GB, more than any one card). Here, in order:

1. the model is built from its config with ``quantization_config`` removed (transformers builds
   a plain model and runs no quantizer of its own) and every parameter on the meta device
   (:func:`hone.models.weight_files.parameters_on_meta`); the buffers (RoPE's ``inv_freq``) are
   computed by the constructor, exactly as a normal load computes them;
2. every expert projection the files hold as ``{name}_blocks`` / ``{name}_scales`` is checked
   from the safetensors headers alone (both present, uint8, the shapes of the module's weight),
   so a bad checkpoint is refused before a byte of it is read;
3. tensor by tensor, straight to the device: blocks and scales become the experts module's
   MXFP4 buffers (:func:`hone.models.experts.mxfp4.attach_mxfp4`), every other parameter is read
   into its dtype; tied parameters get the one tensor; the buffers move to the device.

Neither the whole checkpoint nor any expert weight in bf16 ever exists, on the CPU or the device.
Under expert parallelism (the plan's ``as_drawn`` hook, given by the loader) each experts module
is split on the meta device between steps 2 and 3 (:func:`_split_on_meta`), so each rank reads
only its block of the experts' blocks, scales and biases from the files.
Other quantized checkpoints (fp8, NVFP4, bitsandbytes, GPTQ, AWQ, ...) never get here: reading
their config refuses them, with what hone loads instead
(:func:`hone.models.model_dir.quant_method_problem`, which ``hone validate`` runs too).
"""

from __future__ import annotations

import copy
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from hone.config.model import ModelConfig
from hone.models.attention.sinks import sink_backend_for
from hone.models.errors import ModelError
from hone.models.experts.backend import is_experts_module
from hone.models.experts.mxfp4 import (
    BLOCKS_SUFFIX,
    EXPERT_PROJECTIONS,
    SCALES_SUFFIX,
    attach_mxfp4,
    check_mxfp4_shapes,
    out_in_shape,
)
from hone.models.experts.parallel import SHARDED_TENSORS, expert_shard
from hone.models.materialize import AsDrawn
from hone.models.weight_files import checkpoint_key, parameters_on_meta, weight_files

#: safetensors dtype names -> torch dtypes, for the header-only shape checks.
_HEADER_DTYPES = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
}


def check_mxfp4_run(model: nn.Module, full_finetune: bool) -> None:
    """Refuse, before training, a run that cannot train a base holding MXFP4 experts: their weight
    parameters are placeholders, so only hone's experts backend computes them, and they hold no
    gradient (a full fine-tune would silently freeze them, then save the placeholders)."""
    implementation = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if implementation != "hone":
        raise ModelError(
            f"model.experts_implementation: '{implementation}' cannot compute MXFP4 experts: the base holds them as "
            "4-bit blocks and scales, and only hone's experts backend reads those (model.experts_implementation: "
            "hone; off CUDA it runs a float32 reference)"
        )
    if full_finetune:
        raise ModelError(
            "adapter.type: a full fine-tune cannot train MXFP4 experts (4-bit blocks and scales hold no gradient): "
            "train a LoRA adapter (adapter.type: lora; name 'experts' in adapter.lora_target_modules to adapt the "
            "experts), or fine-tune an unquantized (bf16) checkpoint"
        )


@dataclass(frozen=True)
class _Source:
    """Where one tensor is: its safetensors key and file."""

    key: str
    file: Path


def load_mxfp4_pretrained(
    path: Path,
    config: Any,
    model_cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    key: str = "model.path",
    as_drawn: AsDrawn | None = None,
) -> PreTrainedModel:
    """The causal LM in ``path`` (``config`` read from it, MXFP4 declared) on ``device``: the experts
    as MXFP4 blocks and scales, every other weight in ``dtype``. ``as_drawn``: the plan's hook,
    applied to each experts module on the meta device before any weight is read (expert
    parallelism: the module then holds, and the files give, its rank's block only)."""
    plain = copy.deepcopy(config)
    if hasattr(plain, "quantization_config"):
        delattr(plain, "quantization_config")
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            plain,
            dtype=dtype,
            attn_implementation=sink_backend_for(plain, model_cfg.attn_implementation),
            trust_remote_code=model_cfg.trust_remote_code,
        )
    files = weight_files(path)
    quantized = _mxfp4_sources(model, files, path, key)
    if as_drawn is not None:
        _split_on_meta(model, quantized, files, as_drawn, key)
    with ExitStack() as stack, torch.no_grad():
        opened: dict[Path, Any] = {}

        def read(source: _Source, rows: slice | None = None) -> torch.Tensor:
            if source.file not in opened:
                opened[source.file] = stack.enter_context(_safe_open(source.file, device))
            if rows is None:
                return opened[source.file].get_tensor(source.key)
            return opened[source.file].get_slice(source.key)[rows]

        _place_buffers(model, files, read, device)  # the MXFP4 buffers (not yet there, or on meta) are read once, here
        for (module, name, where), (blocks, scales) in quantized.items():
            rows = _block_rows(module)
            attach_mxfp4(module, name, read(blocks, rows).to(device), read(scales, rows).to(device), where=where)
        _fill_parameters(model, files, path, key, read, device)
    _read_generation_config(model, path)
    model.eval()
    return model


def _block_rows(module: nn.Module) -> slice | None:
    """The rows of the experts a module split by expert parallelism holds (None: all of them)."""
    shard = expert_shard(module)
    return None if shard is None else slice(shard.first, shard.first + shard.local_count)


def _split_on_meta(
    model: nn.Module,
    quantized: dict[tuple[nn.Module, str, str], tuple[_Source, _Source]],
    files: dict[str, Path],
    as_drawn: AsDrawn,
    key: str,
) -> None:
    """Give each MXFP4 projection meta blocks and scales of the files' shapes, then apply the plan's
    hook to every experts module (on the meta device: nothing is read). Expert parallelism's hook
    keeps the rank's block of every expert tensor (placeholders, biases, blocks, scales), which the
    reads then fetch alone; the quantize hook finds the experts in MXFP4 already. A hook that
    would replace an experts module is refused (none of hone's does)."""
    for (module, name, where), (blocks, scales) in quantized.items():
        meta = [torch.empty(_header(s.file, s.key)[0], dtype=torch.uint8, device="meta") for s in (blocks, scales)]
        attach_mxfp4(module, name, *meta, where=where)
    replace = as_drawn(model)
    if replace is None:
        return
    for name, module in model.named_modules():
        if is_experts_module(module) and replace(module) is not None:
            raise ModelError(f"{key}: the plan would replace the experts module '{name}' of an MXFP4 checkpoint as it loads")


def _safe_open(file: Path, device: torch.device):
    from safetensors import safe_open

    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return safe_open(str(file), framework="pt", device=str(device))


def _header(file: Path, tensor_key: str) -> tuple[tuple[int, ...], torch.dtype | str]:
    """(shape, dtype) of one tensor from its file's header (no data read)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        piece = f.get_slice(tensor_key)
        name = piece.get_dtype()
        return tuple(piece.get_shape()), _HEADER_DTYPES.get(name, name)


def _mxfp4_sources(
    model: nn.Module, files: dict[str, Path], path: Path, key: str
) -> dict[tuple[nn.Module, str, str], tuple[_Source, _Source]]:
    """``(module, projection, where) -> (blocks, scales)`` for every expert projection the files
    hold in MXFP4, each checked from the headers: both tensors present, uint8, the right shapes."""
    found = {}
    for module_name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        for name in EXPERT_PROJECTIONS:
            if name not in params:
                continue
            weight = checkpoint_key(f"{module_name}.{name}")
            blocks, scales = weight + BLOCKS_SUFFIX, weight + SCALES_SUFFIX
            if blocks not in files and scales not in files:
                continue  # this checkpoint holds the projection unquantized
            for have, lack in ((blocks, scales), (scales, blocks)):
                if lack not in files:
                    raise ModelError(
                        f"{key}: '{path}' holds the MXFP4 tensor '{have}' (in {files[have].name}) but not '{lack}': "
                        "an MXFP4 expert weight needs both its blocks (uint8 [experts, out, in / 32, 16], packed 4-bit "
                        "values) and its scales (uint8 [experts, out, in / 32], one E8M0 exponent per 32 values). "
                        "Is the download complete?"
                    )
            where = f"{key}: '{blocks}' ({files[blocks].name}) and '{scales}' ({files[scales].name}) in '{path}'"
            check_mxfp4_shapes(
                where, out_in_shape(module, name), _header_meta(files[blocks], blocks), _header_meta(files[scales], scales)
            )
            found[(module, name, where)] = (_Source(blocks, files[blocks]), _Source(scales, files[scales]))
    return found


def _header_meta(file: Path, tensor_key: str) -> torch.Tensor:
    """A meta tensor of the shape and dtype the header gives (float32 for a dtype torch lacks)."""
    shape, dtype = _header(file, tensor_key)
    return torch.empty(shape, dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32, device="meta")


def _fill_parameters(model: nn.Module, files: dict[str, Path], path: Path, key: str, read, device: torch.device) -> None:
    """Read every parameter still on the meta device into its dtype on ``device``; a parameter
    shared by several modules (tied embeddings) is read once and set in every place."""
    places: dict[int, list[tuple[nn.Module, str, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param.device.type == "meta":
                places.setdefault(id(param), []).append((module, name, f"{module_name}.{name}" if module_name else name))
                params[id(param)] = param
    missing = []
    for ident, where in places.items():
        param = params[ident]
        tensor_key = next((checkpoint_key(full) for _, _, full in where if checkpoint_key(full) in files), None)
        if tensor_key is None:
            missing.append(checkpoint_key(where[0][2]))
            continue
        shape, _ = _header(files[tensor_key], tensor_key)
        owner, name, _ = where[0]
        shard = expert_shard(owner) if name in SHARDED_TENSORS else None  # expert parallelism: the rank's block
        expected = tuple(param.shape) if shard is None else (shard.num_experts, *param.shape[1:])
        if shape != expected:
            raise ModelError(
                f"{key}: tensor '{tensor_key}' in {files[tensor_key].name} has shape {shape} where the model expects {expected}"
            )
        rows = None if shard is None else slice(shard.first, shard.first + shard.local_count)
        value = nn.Parameter(
            read(_Source(tensor_key, files[tensor_key]), rows).to(device, param.dtype), requires_grad=param.requires_grad
        )
        for module, name, _ in where:
            setattr(module, name, value)
    if missing:
        shown = ", ".join(sorted(missing)[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelError(
            f"{key}: the weights in '{path}' lack {len(missing)} tensor(s) the model needs ({shown}); "
            "they would start from random values. Is the directory complete?"
        )


def _place_buffers(model: nn.Module, files: dict[str, Path], read, device: torch.device) -> None:
    """Buffers the constructor computed (RoPE's ``inv_freq``, in float32) move to ``device``; one
    the files hold is read from them, as transformers does. Buffers on the meta device are MXFP4
    blocks and scales (:func:`_split_on_meta`), read afterwards."""
    for module_name, module in model.named_modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.device.type == "meta":
                continue
            tensor_key = checkpoint_key(f"{module_name}.{name}" if module_name else name)
            if tensor_key in files:
                setattr(module, name, read(_Source(tensor_key, files[tensor_key])).to(device, buf.dtype))
            elif buf.device != device:
                setattr(module, name, buf.to(device))


def _read_generation_config(model: PreTrainedModel, path: Path) -> None:
    """The checkpoint's ``generation_config.json`` (sampling defaults, stop tokens), as
    ``from_pretrained`` reads it."""
    if (path / "generation_config.json").is_file():
        try:
            model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read '{path / 'generation_config.json'}': {exc}") from None
