"""The parts of a transformers causal LM that hone acts on, found through a PEFT wrapper.

Why one module: the transforms (compile, checkpointing, tiled layers, FSDP2), the memory
estimate and the step all need "the model inside the PEFT wrapper", "the decoder and its head"
and "the decoder layers". Defined once here, they cannot disagree about which modules those are.
"""

from torch import nn


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder, output head) of a transformers causal LM, through a PEFT wrapper.

    The decoder is the model without its head (``get_decoder``); LoRA layers live inside it
    in place, so calling it trains the adapter as the wrapper's forward would.
    """
    base = unwrap_peft(model)
    return base.get_decoder(), base.get_output_embeddings()


def stands_in_for_layer(module: nn.Module) -> bool:
    """Whether ``module`` replaced a decoder layer and runs it inside (a tiled decoder layer)."""
    return getattr(module, "stands_in_for_decoder_layer", False) is True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM, looked up through a PEFT wrapper.

    A layer is a module of one of the classes the model names in ``_no_split_modules`` (the
    unit transformers itself shards and offloads by), or a module that stands in for one (a
    tiled decoder layer, :mod:`hone.transforms.tiled_layers`), outermost first; nested matches
    are skipped.
    """
    base = unwrap_peft(model)
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers: list[nn.Module] = []
    inside: list[str] = []
    for path, module in base.named_modules():
        if (type(module).__name__ in names or stands_in_for_layer(module)) and not any(path.startswith(p + ".") for p in inside):
            layers.append(module)
            inside.append(path)
    return layers


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards ``model`` (any parameter is a DTensor): its checkpoints are then
    Distributed Checkpoint's, and saving it gathers the shards on every rank."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
