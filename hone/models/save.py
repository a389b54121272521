"""Write the final adapter or model, and get/set exactly the weights a run trains.

Final outputs are written whole into a hidden sibling directory and renamed into place, so a
crash mid-save leaves the previous output (or nothing), never a directory that looks complete
but holds half a model.
"""

from pathlib import Path

import torch
from peft import PeftModel
from torch import nn

from hone.atomic import atomic_directory
from hone.config.adapter import AdapterConfig
from hone.models.adapters import unwrap_compiled
from hone.models.errors import ModelError
from hone.models.experts.sharded_state import gather_whole, is_expert_sharded, sharded_tensors
from hone.models.structure import is_sharded


def save_final(model: nn.Module, tokenizer, out_dir: Path, adapter_cfg: AdapterConfig) -> Path:
    """Save the trained result to ``out_dir``, atomically, in safetensors.

    LoRA: a PEFT adapter directory (``PeftModel.from_pretrained(base, out_dir)`` loads it).
    Full fine-tune: a save_pretrained model directory. Both get the tokenizer, so generation
    needs nothing else from the run. A model sharded by FSDP2 is gathered once and written by
    rank 0 (:func:`save_final_sharded`): then every rank must call this.
    """
    model = unwrap_compiled(model)
    if is_sharded(model):  # FSDP2: every rank must call this; rank 0 writes
        import torch.distributed as dist

        return save_final_sharded(model, tokenizer, out_dir, adapter_cfg, is_main=dist.get_rank() == 0)
    if is_expert_sharded(model):  # expert parallel: every rank must call this; rank 0 writes
        import torch.distributed as dist

        return save_final_expert_parallel(model, tokenizer, out_dir, adapter_cfg, is_main=dist.get_rank() == 0)
    if adapter_cfg.is_lora != isinstance(model, PeftModel):
        raise ModelError(
            f"save_final: adapter.type is '{adapter_cfg.type}' but the model is "
            f"{'a PEFT model' if isinstance(model, PeftModel) else 'a plain model'}"
        )
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        write_model(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return out_dir


def write_model(model: nn.Module, directory: Path) -> None:
    """save_pretrained in safetensors (a PEFT model writes only its adapter).

    ``save_embedding_layers=False``: hone never resizes embeddings, and PEFT's ``"auto"`` asks the
    Hub about the base model whenever its local directory is gone.
    """
    if isinstance(model, PeftModel):
        model.save_pretrained(str(directory), safe_serialization=True, save_embedding_layers=False)
    else:
        model.save_pretrained(str(directory))


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Exactly the weights the optimizer updates (LoRA + modules_to_save, or every weight),
    as contiguous CPU copies ready for ``safetensors.torch.save_file``.

    Keys are ``named_parameters`` names of ``model`` as given (a PEFT model's names include
    ``base_model.model.``), so they round-trip through :func:`load_trainable_state_dict` on a
    model built the same way. Tied weights appear once, so no two tensors share memory.
    """
    model = unwrap_compiled(model)
    return {
        name: param.detach().to("cpu", copy=True).contiguous() for name, param in model.named_parameters() if param.requires_grad
    }


@torch.no_grad()
def load_trainable_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Copy ``state_dict`` into the trainable weights of ``model`` (in their dtype and device).

    The key sets must match exactly: a checkpoint from a run with another adapter or model
    would otherwise resume with part of its weights silently untouched.
    """
    model = unwrap_compiled(model)
    params = {name: param for name, param in model.named_parameters() if param.requires_grad}
    missing = sorted(set(params) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(params))
    if missing or unexpected:
        parts = [
            f"{len(keys)} {label} (e.g. {', '.join(keys[:3])})"
            for label, keys in (
                ("trainable weight(s) missing from it", missing),
                ("weight(s) the model does not train", unexpected),
            )
            if keys
        ]
        raise ModelError(
            f"{source} does not match the model's trainable weights: {'; '.join(parts)}. It was "
            "written by a run with another model or adapter config; use that config, or start a new run"
        )
    for name, param in params.items():
        value = state_dict[name]
        if value.shape != param.shape:
            raise ModelError(
                f"{source}: weight '{name}' has shape {tuple(value.shape)} but the model's is "
                f"{tuple(param.shape)} (another lora_r or model size?)"
            )
        param.copy_(value.to(param.device, param.dtype))


def gathered_state_dict(model: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict of an FSDP2-sharded model, on rank 0's CPU (other ranks
    get an empty dict). Every rank must call it: the shards are all-gathered one tensor at a
    time and offloaded to the CPU, so no GPU holds the whole model. ``trainable_only`` (LoRA)
    gathers just the adapter weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(unwrap_compiled(model), options=options)


def save_final_sharded(model: nn.Module, tokenizer, out_dir: Path, adapter_cfg: AdapterConfig, is_main: bool) -> Path:
    """:func:`save_final` for an FSDP2-sharded model: the weights are gathered once (all ranks
    call this), and rank 0 writes the same formats as one process does (a PEFT adapter
    directory, or a save_pretrained model directory), atomically."""
    state = gathered_state_dict(model, trainable_only=adapter_cfg.is_lora)
    if is_expert_sharded(unwrap_compiled(model)):  # beside FSDP2 the expert blocks are plain: each rank's own
        state.update(expert_parallel_state_dict(model, trainable_only=adapter_cfg.is_lora, keep=is_main, experts_only=True))
    out_dir = Path(out_dir)
    if not is_main:
        return out_dir
    return write_whole(unwrap_compiled(model), tokenizer, out_dir, state)


def expert_parallel_state_dict(
    model: nn.Module, trainable_only: bool, keep: bool, experts_only: bool = False
) -> dict[str, torch.Tensor]:
    """The whole state dict of an expert-parallel model (every expert of every layer, the expert
    LoRA factors in PEFT's layout for all ``E`` experts), on the CPU of the rank that ``keep``s it
    (the others get an empty dict). Every rank must call it: each sharded tensor is all-gathered,
    one at a time. ``trainable_only`` (LoRA): just the weights the run trains. ``experts_only``:
    just the expert blocks, gathered (beside FSDP2, which gathers the rest)."""
    model = unwrap_compiled(model)
    specs = sharded_tensors(model)
    if trainable_only:
        tensors = {name: p for name, p in model.named_parameters() if p.requires_grad}
    elif experts_only:
        tensors = dict(model.named_parameters())
    else:
        tensors = model.state_dict()
    if experts_only:
        tensors = {name: value for name, value in tensors.items() if name in specs}
    return gather_whole(tensors, specs, keep)


def save_final_expert_parallel(model: nn.Module, tokenizer, out_dir: Path, adapter_cfg: AdapterConfig, is_main: bool) -> Path:
    """:func:`save_final` for a model whose experts are split over the ranks: every rank's
    blocks are gathered (all ranks call this) and rank 0 writes what one process writes: a PEFT
    adapter for all ``E`` experts, or a save_pretrained model directory, atomically."""
    model = unwrap_compiled(model)
    if adapter_cfg.is_lora != isinstance(model, PeftModel):
        raise ModelError(
            f"save_final: adapter.type is '{adapter_cfg.type}' but the model is "
            f"{'a PEFT model' if isinstance(model, PeftModel) else 'a plain model'}"
        )
    state = expert_parallel_state_dict(model, trainable_only=adapter_cfg.is_lora, keep=is_main)
    out_dir = Path(out_dir)
    if not is_main:
        return out_dir
    return write_whole(model, tokenizer, out_dir, state)


def write_whole(model: nn.Module, tokenizer, out_dir: Path, state: dict[str, torch.Tensor]) -> Path:
    """Write ``state`` (the whole model's, gathered from its shards) in ``model``'s format: a PEFT
    adapter directory, or a save_pretrained model directory; atomically, with the tokenizer."""
    with atomic_directory(out_dir) as tmp:
        if isinstance(model, PeftModel):
            model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True, save_embedding_layers=False)
        else:
            model.save_pretrained(str(tmp), state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return out_dir
