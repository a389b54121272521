"""LoRA on the experts, computed by hone's fused kernels and saved as PEFT saves it.

PEFT (0.21) adapts a 3-D expert parameter through ``target_parameters``: a ``ParamWrapper``
per parameter (nested when both ``gate_up_proj`` and ``down_proj`` are targeted) holding
``lora_A [r*E, in]`` and ``lora_B [out, r*E]``. Its forward parametrizes the parameter as
``W + s * B A`` for the whole expert stack (a full-size weight built every step) and calls the
experts as usual. :class:`HoneExpertsLora` is a ``ParamWrapper`` in every respect but its
forward: the outermost wrapper collects the factors of every wrapper in the chain and calls
:func:`hone.models.experts.backend.hone_experts_forward` with them, so ``x W + s (x A^T) B^T``
runs inside the grouped GEMMs and no full-size delta ever exists.

It plugs in through PEFT's custom-module mapping (``LoraConfig._register_custom_module``,
PEFT's documented way to supply a LoRA layer for a module type): the state dict keys, the
``adapter_config.json`` (``target_parameters``) and merging are PEFT's own, so a saved adapter
loads with a plain ``PeftModel.from_pretrained`` and ``hone merge`` folds it with PEFT's
``merge_and_unload``. Anything this forward does not cover (adapters disabled or merged,
several active adapters, mixed-adapter batches) falls back to PEFT's own forward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from peft import LoraConfig
from peft.tuners.lora.layer import ParamWrapper as PeftParamWrapper
from torch import nn

from hone.kernels.moe_lora_reference import LoraFactors
from hone.models.experts.backend import experts_modules, hone_experts_forward
from hone.models.experts.parallel import expert_shard, local_block


def expert_lora_factors(layer: PeftParamWrapper, adapter: str) -> LoraFactors:
    """PEFT's per-expert view of one wrapper's factors: ``A [E, r, in]``, ``B [E, out, r]``
    (the shapes of ``ParamWrapper.get_delta_factors``; views, so gradients reach the adapter)."""
    experts = layer.num_experts
    a = layer.lora_A[adapter].weight
    b = layer.lora_B[adapter].weight
    return a.view(experts, -1, a.shape[-1]), b.view(b.shape[0], -1, experts).permute(2, 0, 1)


class ParamWrapper(PeftParamWrapper):
    """PEFT's ``ParamWrapper`` whose forward runs hone's fused expert kernels (see the module
    docstring). Exported as :data:`HoneExpertsLora`; the class keeps PEFT's name because PEFT
    (0.21) recognises a parameter wrapper, to nest the next one around it, by its class name."""

    def _fused_factors(self) -> tuple[dict[str, LoraFactors], dict[str, float]] | None:
        """Factors and scalings of every wrapper in the chain, or None where PEFT's forward must run."""
        factors: dict[str, LoraFactors] = {}
        scalings: dict[str, float] = {}
        layer: nn.Module = self
        while isinstance(layer, PeftParamWrapper):
            if not isinstance(layer, HoneExpertsLora) or layer.disable_adapters or layer.merged:
                return None
            active = [name for name in layer.active_adapters if name in layer.lora_A]
            if len(active) > 1:
                return None
            if active:
                factors[layer.parameter_name] = expert_lora_factors(layer, active[0])
                scalings[layer.parameter_name] = float(layer.scaling[active[0]])
            layer = layer.base_layer
        return factors, scalings

    def reset_lora_parameters(self, adapter_name: str, init_lora_weights: Any) -> None:
        """PEFT's default init (A kaiming-uniform, B zero), and under expert parallelism the
        rank's block of what one process holding every expert draws: PEFT built this rank's
        factors for ``E / N`` experts, so the values the whole factors' constructors would also
        have drawn are skipped first, and A is drawn whole and cut. The generator then stands
        where one process's does, so every later LoRA layer starts as in one process too."""
        shard = expert_shard(self.get_base_layer())
        if shard is None or shard.size == 1 or init_lora_weights is not True or adapter_name not in self.lora_A:
            super().reset_lora_parameters(adapter_name, init_lora_weights)
            return
        a, b = self.lora_A[adapter_name].weight, self.lora_B[adapter_name]
        with torch.no_grad():
            skipped = (shard.size - 1) * (a.numel() + b.weight.numel())  # nn.Linear draws one value per weight
            torch.empty(skipped, dtype=a.dtype, device=a.device).uniform_()
            whole = torch.empty(a.shape[0] * shard.size, a.shape[1], dtype=a.dtype, device=a.device)
            nn.init.kaiming_uniform_(whole, a=math.sqrt(5))
            a.copy_(local_block("lora_A.weight", whole, shard))
            nn.init.zeros_(b.weight)
            if b.bias is not None:
                nn.init.zeros_(b.bias)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        fused = None if kwargs.get("adapter_names") is not None else self._fused_factors()
        if fused is None:
            return super().forward(x, *args, **kwargs)
        factors, scalings = fused
        return hone_experts_forward(self.get_base_layer(), x, *args, lora=factors, lora_scaling=scalings, **kwargs)


HoneExpertsLora = ParamWrapper


def register_fused_expert_lora(config: LoraConfig, model: nn.Module) -> list[str]:
    """Have PEFT build :class:`HoneExpertsLora` for every experts module class of ``model``;
    returns the class names (for the plan record)."""
    classes = {type(module) for _, module in experts_modules(model)}
    config._register_custom_module({cls: HoneExpertsLora for cls in classes})
    return sorted(cls.__name__ for cls in classes)
