"""What a module recomputed piece by piece in its own backward needs, shared by the tiled MLP
(shards of tokens) and tiled decoder layers (chunks of the sequence).

Why: both run a module under ``no_grad`` in the forward, keep only its input, and recompute
each piece with grad in the backward. The recompute must see what the forward saw (autocast and,
with dropout, the random numbers) and the parameters' gradients, one per piece, must leave the
``autograd.Function`` once, summed in float32 whatever the parameters' dtype.
"""

from contextlib import ExitStack

import torch
from torch import nn


def has_dropout(module: nn.Module) -> bool:
    """Whether ``module`` draws random numbers in training: a dropout module (LoRA's) or an
    attention dropout probability (transformers' attention modules keep it as a float)."""
    for m in module.modules():
        if not m.training:
            continue
        if isinstance(m, nn.Dropout) and m.p > 0:
            return True
        if isinstance(getattr(m, "attention_dropout", None), float) and m.attention_dropout > 0:
            return True
    return False


class Replay:
    """The state a piece's recompute must reproduce: autocast, and with dropout the RNG state the
    piece started from in the forward (:meth:`capture` before each piece; pieces the forward ran
    in one go from one state are captured once and replayed in the same order)."""

    def __init__(self, x: torch.Tensor, dropout: bool) -> None:
        self.device_type = x.device.type
        self.device = x.device
        self.autocast = torch.is_autocast_enabled(self.device_type)
        self.autocast_dtype = torch.get_autocast_dtype(self.device_type)
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.dropout = dropout
        self.rng: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def capture(self) -> None:
        """Record the RNG state of the piece about to run (with dropout only)."""
        if self.dropout:
            cuda = torch.cuda.get_rng_state(self.device) if self.device_type == "cuda" else None
            self.rng.append((torch.get_rng_state(), cuda))

    def context(self, piece: int, grad: bool) -> ExitStack:
        """Grad mode, the forward's autocast and, with dropout, piece ``piece``'s RNG state (the
        caller's RNG is restored on exit)."""
        stack = ExitStack()
        stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
        stack.enter_context(
            torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast, cache_enabled=self.autocast_cache)
        )
        if self.dropout:
            cpu, cuda = self.rng[piece]
            devices = [self.device] if cuda is not None else []
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type=self.device_type))
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.device)
        return stack


class GradSums:
    """Each parameter's gradient summed over the pieces in float32, handed back once in the
    parameter's own dtype (None for a parameter no piece reached)."""

    def __init__(self, count: int) -> None:
        self.sums: list[torch.Tensor | None] = [None] * count

    def add(self, index: int, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        if self.sums[index] is None:
            self.sums[index] = grad if grad.dtype == torch.float32 else grad.float()
        else:
            self.sums[index].add_(grad)  # type: ignore[union-attr]

    def result(self, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        return [None if s is None else s.to(p.dtype) for s, p in zip(self.sums, params)]
