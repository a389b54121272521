"""Where a model's weights are in its safetensors files, and a model built without its weights.

Shared by the loaders that build a model on the meta device and then read its weights tensor by
tensor: the FSDP2 sharded load (:mod:`hone.models.sharded_load`) and the MXFP4 checkpoint load
(:mod:`hone.models.mxfp4_checkpoint`). A leaf module, so that neither imports the other.
"""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn


@contextmanager
def parameters_on_meta(keep: dict[int, torch.Tensor] | None = None) -> Iterator[None]:
    """Every parameter registered inside the block lands on the meta device.

    With ``keep``, parameters are left where they are created instead and their storage is
    recorded (``id(module) -> tensor`` under ``"<id>.<name>"``), so values drawn in place later
    survive a move to the meta device (PEFT moves new adapters next to their base layer)."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    def to_meta(module: nn.Module, name: str, param):
        if param is None or param.device.type == "meta":
            return None
        if keep is not None:
            keep[f"{id(module)}.{name}"] = param.data
            return None
        return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def checkpoint_key(name: str) -> str:
    """The safetensors key of a parameter of the (possibly PEFT-wrapped) model."""
    key = name.removeprefix("base_model.model.")
    for infix in (".base_layer", ".original_module"):
        key = key.replace(infix, "")
    return key.replace(".modules_to_save.default", "")


def weight_files(path: Path) -> dict[str, Path]:
    """safetensors key -> file, from the index of a sharded save or the single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {key: path / file for key, file in weight_map.items()}
    from safetensors import safe_open

    single = path / "model.safetensors"
    with safe_open(str(single), framework="pt") as f:
        return {key: single for key in f.keys()}
