"""How a transform's weights leave and enter a checkpoint: the contract between the transforms
that change how parameters are stored (quantized, sharded) and the checkpoint writer in
:mod:`hone.train.checkpoint`. It lives below both packages so that neither imports the other."""

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateDictHooks:
    """``save`` maps the state dict about to be written, ``load`` the one read back (e.g.
    quantized or sharded weights); a checkpoint applies the plan's hooks in plan order on save
    and in reverse order on load."""

    save: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    load: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
