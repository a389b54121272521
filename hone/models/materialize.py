"""Draw a random-initialised model on its device one module at a time, from a meta-device skeleton.

Why: a big preset built the ordinary way (``from_config``) allocates and initialises the whole
model where it is built. On the CPU an 8B model takes minutes; a quantized base (QLoRA) must
never exist whole in full precision, neither on the CPU nor on the GPU. Here nothing exists
whole before it is in its final form:

1. :func:`build_skeleton` constructs the model under ``torch.device("meta")``: shapes and dtypes,
   no memory, no random draws (transformers skips its weight init on the meta device);
2. :func:`materialize` visits the modules in the order of transformers' own
   ``initialize_weights`` (children before their parent; a sub-model with its own
   ``_init_weights``), allocates each module's own parameters and buffers on the device and
   initialises them with the model's ``_init_weights``, the hook transformers' ``from_pretrained``
   uses for every weight a checkpoint lacks. That hook also recomputes the non-persistent buffers
   that a meta skeleton leaves empty (RoPE's ``inv_freq``, Gemma's ``embed_scale``), exactly as
   ``from_pretrained`` relies on;
3. ``replace(module)`` may swap the module just drawn for another (a linear layer for its 4-bit
   form) before the next one is drawn, so the full-precision model never exists whole.

The draws are those of transformers' ``initialize_weights()`` from the same seed on a model
built the ordinary way: same values bit for bit on the same device and dtype (a CPU test
compares every preset family), and the same buffers. Tied parameters (an output head tied to
the embedding) stay one tensor, initialised in the same order as ``initialize_weights`` does.
"""

from collections.abc import Callable, Iterator
from itertools import chain

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from hone.models.errors import ModelError

#: Swaps a module just drawn for another (returned), or keeps it (``None``).
Replace = Callable[[nn.Module], nn.Module | None]
#: Given a meta skeleton, the :data:`Replace` to apply while drawing it (None: keep every module).
AsDrawn = Callable[[nn.Module], Replace | None]


def build_skeleton(config, dtype: torch.dtype, **kwargs) -> PreTrainedModel:
    """The causal LM of ``config`` in ``dtype`` with every parameter and buffer on the meta device
    (``kwargs`` go to ``from_config``, e.g. ``attn_implementation``)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)


@torch.no_grad()
def materialize(model: PreTrainedModel, device: torch.device | str, replace: Replace | None = None) -> PreTrainedModel:
    """Allocate and initialise ``model`` (a meta skeleton) on ``device`` one module at a time, in
    place; draws from the current random state of ``device``. Returns ``model``."""
    device = torch.device(device)
    tied = _shared_parameters(model)
    drawn: dict[int, nn.Parameter] = {}
    visited: set[int] = set()
    for parent, name, module, owner in _init_order(model, model, None, ""):
        if id(module) in visited:  # a module registered under two parents is drawn once
            continue
        visited.add(id(module))
        _allocate(module, device, tied, drawn)
        owner._init_weights(module)
        if replace is not None and parent is not None:
            new = replace(module)
            if new is not None:
                setattr(parent, name, new)
    left = [name for name, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        raise ModelError(
            f"{type(model).__name__}: {len(left)} tensor(s) were not drawn on {device} ({', '.join(left[:5])}); "
            "the model has a tensor outside any module's own parameters and buffers"
        )
    return model


def _init_order(
    module: nn.Module, owner: PreTrainedModel, parent: nn.Module | None, name: str
) -> Iterator[tuple[nn.Module | None, str, nn.Module, PreTrainedModel]]:
    """(parent, attribute, module, whose ``_init_weights``) in the order of transformers'
    ``initialize_weights`` (its ``smart_apply``): children first, then the module itself; a child
    that is a ``PreTrainedModel`` initialises its own subtree. Lazy, so a module replaced after it
    is drawn is no longer referenced here."""
    for child_name, child in module.named_children():
        child_owner = child if isinstance(child, PreTrainedModel) else owner
        yield from _init_order(child, child_owner, module, child_name)
    yield parent, name, module, owner


def _shared_parameters(model: nn.Module) -> dict[int, nn.Parameter]:
    """Meta parameters registered in more than one place (tied weights), by id; the values keep
    the meta tensors alive so their ids stay theirs."""
    seen: dict[int, nn.Parameter] = {}
    shared: dict[int, nn.Parameter] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            shared[id(param)] = param
        seen[id(param)] = param
    return shared


def _allocate(module: nn.Module, device: torch.device, tied: dict[int, nn.Parameter], drawn: dict[int, nn.Parameter]) -> None:
    """Give ``module``'s own parameters and buffers uninitialised storage on ``device`` (what
    ``to_empty(recurse=False)`` does), keeping a tied parameter one tensor across its modules."""
    for name, param in list(module.named_parameters(recurse=False)):
        if not param.is_meta:
            continue
        key = id(param)
        if key in drawn:
            new = drawn[key]
        else:
            new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
            if key in tied:
                drawn[key] = new
        setattr(module, name, new)
    for name, buffer in list(module.named_buffers(recurse=False)):
        if buffer.is_meta:
            setattr(module, name, torch.empty_like(buffer, device=device))
