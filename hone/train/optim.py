"""AdamW over the trainable parameters, and the learning-rate schedule.

Weight decay applies to matrices only (``ndim >= 2``: linear and embedding weights, LoRA A/B).
Biases and normalisation weights (every 1-D parameter) are not decayed: pulling a norm's gain
or a bias towards zero is not a regulariser, it shifts the layer (the usual convention of
GPT-2/LLaMA training code and Hugging Face's Trainer).

``optimizer.name: adamw_8bit`` / ``adamw_4bit`` build torchao's low-bit AdamW over the same
groups: the same decoupled weight decay and bias correction, the moments block-quantized (their
state is a tensor subclass that ``torch.save`` and ``optimizer.load_state_dict`` carry whole, so a
resumed run continues bit for bit). torchao keeps each group's learning rate as a tensor and
refuses a float in its place: :func:`set_lr` writes either kind.

The schedule is a ``LambdaLR`` whose factor is a small callable object, so its whole state
(shape, warm-up, total, floor) travels in ``scheduler.state_dict()`` and a resumed run
continues the exact curve.
"""

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from hone.config.optimizer import LOW_BIT_ADAMW, LOW_BIT_INSTALL_HINT, OptimizerConfig
from hone.errors import HoneError


def trainable_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def decays(name: str, param: torch.Tensor) -> bool:
    """Whether weight decay applies: matrices yes, biases and norm gains (1-D) no."""
    return param.ndim >= 2


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The decayed and the undecayed weights, each split by kind where a run mixes FSDP2's
    DTensors with plain tensors (expert parallelism beside FSDP2: the experts' blocks stay
    plain). torch's foreach and fused AdamW update a group in one multi-tensor call, which
    refuses DTensors and plain tensors together; each group holds one kind, so the update of
    every weight is the one it gets alone (the math is per element)."""
    named = trainable_named_parameters(model)
    decay = [p for n, p in named if decays(n, p)]
    no_decay = [p for n, p in named if not decays(n, p)]
    groups = []
    for params, decayed in ((decay, weight_decay), (no_decay, 0.0)):
        groups.extend({"params": part, "weight_decay": decayed} for part in _one_kind_each(params))
    return groups


def _one_kind_each(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` as the DTensors, then the plain tensors (the non-empty ones; order kept)."""
    if not torch.distributed.is_available():
        return [params] if params else []
    from torch.distributed.tensor import DTensor

    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [part for part in (sharded, plain) if part]


def use_fused(cfg: OptimizerConfig, device: torch.device) -> bool:
    if cfg.fused == "auto":
        return device.type == "cuda"
    return bool(cfg.fused)


def low_bit_adamw(name: str, device: torch.device) -> type[torch.optim.Optimizer]:
    """torchao's class for ``optimizer.name``, or a clear error for a missing package or device."""
    if device.type not in ("cuda", "cpu"):
        raise HoneError(f"optimizer.name: {name} runs on CUDA or the CPU, not on {device.type}: set optimizer.name: adamw")
    try:
        import torchao.optim
    except ImportError:
        raise HoneError(
            f"optimizer.name: {name} needs the Python package 'torchao' (>= 0.18), which is not installed: "
            f"{LOW_BIT_INSTALL_HINT}, or set optimizer.name: adamw"
        ) from None
    # torch's AOT cache notes, once per state class, that torchao's subclass has no cache hash:
    # about torch's compile cache, nothing the user can act on
    warnings.filterwarnings("ignore", message=r"OptimState\w+ does not implement _stable_hash_for_caching")
    return getattr(torchao.optim, LOW_BIT_ADAMW[name][0])


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    if cfg.name in LOW_BIT_ADAMW:
        adamw = low_bit_adamw(cfg.name, device)
        betas = (cfg.adam_beta1, cfg.adam_beta2)
        return adamw(groups, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(
        groups,
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        weight_decay=cfg.weight_decay,
        fused=use_fused(cfg, device) or None,
    )


def set_lr(group: dict, lr: float) -> None:
    """Set a param group's learning rate in place: a tensor (torchao's optimizers) or a float."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


@dataclass
class LRSchedule:
    """Multiplier of the peak learning rate at scheduler step ``i`` (0-based optimizer step).

    Warm-up: step ``i < warmup`` uses ``(i + 1) / warmup``, so the first step already moves
    (no wasted step at lr 0) and step ``warmup - 1`` reaches the peak. After warm-up,
    ``progress = (i - warmup) / (total - warmup)`` runs from 0 towards 1 and

    - constant: 1
    - linear:   ``floor + (1 - floor) * (1 - progress)``
    - cosine:   ``floor + (1 - floor) * (1 + cos(pi * progress)) / 2``

    with ``floor = cosine_min_lr_ratio``. Steps past ``total`` (a run extended on resume) stay
    at the floor.
    """

    kind: str
    warmup: int
    total: int
    floor: float

    def __call__(self, i: int) -> float:
        if i < self.warmup:
            return (i + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (i - self.warmup) / max(1, self.total - self.warmup))
        if self.kind == "linear":
            shape = 1.0 - progress
        elif self.kind == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            raise ValueError(f"unknown lr_scheduler {self.kind!r}")
        return self.floor + (1.0 - self.floor) * shape


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> LRSchedule:
    return LRSchedule(
        kind=cfg.lr_scheduler,
        warmup=cfg.warmup_for(total_steps),
        total=total_steps,
        floor=cfg.cosine_min_lr_ratio,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int) -> LambdaLR:
    """The schedule as a ``LambdaLR``: call ``.step()`` once after each optimizer step."""
    return LambdaLR(optimizer, make_schedule(cfg, total_steps))
