"""Adapters: LoRA through PEFT's public API, or a full fine-tune.

Names in ``lora_target_modules`` and ``lora_modules_to_save`` are checked against the model
first: PEFT silently skips a misspelt name as long as another one matches, and a LoRA run that
quietly trains fewer layers than asked is worse than an error.

``all-linear`` is resolved here, to the names of the ``nn.Linear`` layers except the output
head, rather than handed to PEFT: PEFT (0.21, transformers 5) maps v4-era MoE names onto the
fused expert parameters, so its own ``all-linear`` on Qwen3-MoE also wraps the experts and the
router with ``target_parameters`` wrappers. hone adapts the experts only where the config names
them: ``experts`` (an experts module: both its ``gate_up_proj`` and ``down_proj``) or the
experts' 3-D parameters themselves (``gate_up_proj``, ``down_proj``, ``experts.down_proj``).
Those become PEFT ``target_parameters`` (saved in PEFT's layout, loadable by
``PeftModel.from_pretrained``); under ``model.experts_implementation: hone`` their LoRA runs
inside hone's fused grouped-GEMM kernels (:mod:`hone.models.experts.lora`), otherwise through
PEFT's own wrapper (a full-size delta of every expert's weights each forward). Expert LoRA
cannot use ``lora_dropout`` (PEFT's ``ParamWrapper`` refuses it: the dropout cannot be
factored out of ``x (W + BA)``). Anything else PEFT would map onto expert or router
parameters on its own is refused with an explanation.
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import AuxiliaryTrainingWrapper
from torch import nn

from hone.config.adapter import AdapterConfig
from hone.models.errors import ModelError
from hone.models.nf4 import NF4Linear, has_nf4, register_nf4_lora

#: Linear layer types: ``nn.Linear`` and QLoRA's frozen 4-bit :class:`~hone.models.nf4.NF4Linear`.
LINEAR_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, NF4Linear)

#: Module types LoRA can wrap through ``target_modules`` in a causal LM.
LORA_MODULE_TYPES: tuple[type[nn.Module], ...] = (*LINEAR_TYPES, nn.Embedding)


def apply_adapter(model: nn.Module, adapter_cfg: AdapterConfig) -> nn.Module:
    """Return the model to train: a PEFT LoRA wrapper, or ``model`` with every weight trainable.

    LoRA weights are created in float32 whatever the base dtype (PEFT's
    ``autocast_adapter_dtype``); see :mod:`hone.models.precision` for the convention.
    """
    if not adapter_cfg.is_lora:
        for param in model.parameters():
            param.requires_grad_(True)
        return model
    config = lora_config(model, adapter_cfg)
    # PEFT rewrites the config's targets in place (its transformers-5 MoE conversion): keep what was asked.
    asked_modules, asked_parameters = list(config.target_modules or []), list(config.target_parameters or [])
    if config.target_parameters and getattr(getattr(model, "config", None), "_experts_implementation", None) == "hone":
        from hone.models.experts.lora import register_fused_expert_lora

        register_fused_expert_lora(config, model)
    if has_nf4(model):  # QLoRA: PEFT's LoRA layer around hone's 4-bit linear (model.quantize)
        register_nf4_lora(config)
    try:
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as exc:  # PEFT's refusals of a setting for a layer type
        raise ModelError(f"adapter: PEFT cannot apply LoRA {describe_lora(config)} to {type(model).__name__}: {exc}") from None
    check_no_expert_lora(peft_model, adapter_cfg, requested=asked_parameters)
    check_module_targets_kept(peft_model, asked_modules)
    return peft_model


def record_base_model(model: nn.Module, name_or_path: str, revision: str | None = None) -> None:
    """Name the base model in the adapter's config (``base_model_name_or_path``, saved into
    ``adapter_config.json``): PEFT takes the name the model was loaded under, a relative
    directory when the config gave one, which breaks ``AutoPeftModelForCausalLM`` (and any
    reader of the adapter) outside the directory the run started in. No-op for a full fine-tune."""
    if not isinstance(model, PeftModel):
        return
    for config in model.peft_config.values():
        config.base_model_name_or_path = name_or_path
        if revision is not None:
            config.revision = revision


def lora_config(model: nn.Module, adapter_cfg: AdapterConfig) -> LoraConfig:
    """PEFT's config for ``adapter_cfg``, after checking every name against ``model``."""
    to_save = list(adapter_cfg.lora_modules_to_save)
    parameters: list[str] = []
    if adapter_cfg.lora_target_modules == "all-linear":
        targets = all_linear_names(model, exclude=to_save)
    else:
        requested = list(adapter_cfg.lora_target_modules)
        targets, parameters = split_expert_targets(model, requested)
        check_target_modules(model, targets)
        if parameters and adapter_cfg.lora_dropout:
            raise ModelError(
                f"adapter.lora_dropout: {adapter_cfg.lora_dropout} cannot apply to LoRA on the experts "
                f"({', '.join(parameters)}): PEFT's expert LoRA has no dropout; set lora_dropout: 0"
            )
    check_modules_to_save(model, to_save, targets)
    return LoraConfig(
        r=adapter_cfg.lora_r,
        lora_alpha=adapter_cfg.lora_alpha,
        lora_dropout=adapter_cfg.lora_dropout,
        target_modules=targets or None,
        target_parameters=parameters or None,
        use_rslora=adapter_cfg.use_rslora,
        modules_to_save=to_save or None,
        bias="none",
        task_type="CAUSAL_LM",
        # A tied head and embedding are one weight: training a copy of only one of them would
        # silently untie them, and a merged model, still marked tied, would drop that copy.
        ensure_weight_tying=touches_tied_embedding(model, [*to_save, *targets]),
    )


def describe_lora(config: LoraConfig) -> str:
    params = f", parameters={sorted(config.target_parameters)}" if config.target_parameters else ""
    return f"(r={config.r}, dropout={config.lora_dropout}, targets={sorted(config.target_modules or [])}{params})"


#: The 3-D parameters of an experts module that LoRA adapts (PEFT ``target_parameters``).
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def split_expert_targets(model: nn.Module, targets: list[str]) -> tuple[list[str], list[str]]:
    """(module targets, expert parameter targets) of ``lora_target_modules``. A name that
    matches an experts module (``experts``) stands for its gate_up_proj and down_proj; a name
    that matches an expert 3-D parameter (``gate_up_proj``, ``experts.down_proj``) is that
    parameter, and also a module target if linear layers carry the name too (a dense MLP's
    ``down_proj`` beside the experts' in a mixed model)."""
    from hone.models.experts.backend import experts_modules

    experts = experts_modules(model)
    expert_params = [
        f"{name}.{param}"
        for name, module in experts
        for param in EXPERT_PARAMETERS
        if isinstance(getattr(module, param, None), torch.Tensor)
    ]
    modules = dict(model.named_modules())
    module_targets: list[str] = []
    parameter_targets: list[str] = []
    for target in targets:
        if any(_matches(name, target) for name, _ in experts):
            parameter_targets += [f"{target}.{param}" for param in EXPERT_PARAMETERS]
            continue
        if any(_matches(name, target) for name in expert_params):
            parameter_targets.append(target)
            if not any(isinstance(m, LORA_MODULE_TYPES) for name, m in modules.items() if name and _matches(name, target)):
                continue
        module_targets.append(target)
    return module_targets, list(dict.fromkeys(parameter_targets))


def _matches(name: str, target: str) -> bool:
    """PEFT's rule for a list of target names: the full name, or a dotted suffix of it."""
    return name == target or name.endswith("." + target)


def linear_module_names(model: nn.Module) -> list[str]:
    """Short names of the linear layers (``q_proj``, ``down_proj``, ``lm_head`` ...)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, LINEAR_TYPES)})


def all_linear_names(model: nn.Module, exclude: list[str]) -> list[str]:
    """What ``all-linear`` means: every linear layer but the output head (and modules_to_save)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, LINEAR_TYPES) and module is not head
    }
    return sorted(names - set(exclude))


def check_no_expert_lora(model: PeftModel, adapter_cfg: AdapterConfig, requested: list[str] | None = None) -> None:
    """Refuse what PEFT turned into LoRA on fused MoE parameters beyond the ``requested`` ones
    (see the module docstring)."""
    mapped = sorted(set(model.peft_config[model.active_adapter].target_parameters or []) - set(requested or []))
    if mapped:
        raise ModelError(
            f"adapter.lora_target_modules: on {type(model.get_base_model()).__name__}, PEFT maps "
            f"{adapter_cfg.lora_target_modules} onto the fused expert/router parameters {mapped} "
            "(MoE layers keep their experts as 3-D parameters in transformers 5); name the experts "
            "explicitly to adapt them ('experts', or 'gate_up_proj' / 'down_proj'), and the attention "
            "projections (q_proj, k_proj, v_proj, o_proj) for the rest"
        )


def check_module_targets_kept(model: PeftModel, requested: list[str]) -> None:
    """Refuse a module target PEFT dropped: its transformers-5 conversion moves any target
    ending in a v4 MoE name (``down_proj``) onto the fused expert parameter, so a dense MLP's
    ``down_proj`` beside the experts would silently stay frozen."""
    kept = set(model.peft_config[model.active_adapter].target_modules or [])
    dropped = sorted(set(requested) - kept)
    if dropped:
        raise ModelError(
            f"adapter.lora_target_modules: on {type(model.get_base_model()).__name__}, PEFT maps {dropped} "
            "onto the experts' fused parameters instead of the linear layers of that name (MoE layers keep "
            "their experts as 3-D parameters in transformers 5), so those linear layers would stay frozen; "
            "LoRA can adapt these names on the experts only: keep them for the experts, or remove them"
        )


def check_target_modules(model: nn.Module, targets: list[str]) -> None:
    """Every target must name at least one module LoRA can wrap."""
    modules = dict(model.named_modules())
    for target in targets:
        matched = [module for name, module in modules.items() if name and _matches(name, target)]
        if any(isinstance(module, LORA_MODULE_TYPES) for module in matched):
            continue
        available = ", ".join(linear_module_names(model))
        arch = type(model).__name__
        if matched:
            kind = type(matched[0]).__name__
            experts = any(isinstance(p, nn.Parameter) and p.dim() == 3 for p in matched[0].parameters(recurse=False))
            why = (
                f"it is a {kind} holding fused expert weights as 3-D parameters that hone does not "
                "know as an experts module (LoRA on experts covers transformers' experts modules: "
                "name them 'experts', or their 'gate_up_proj' / 'down_proj')"
                if experts
                else f"it is a {kind}, not a linear or embedding layer"
            )
            raise ModelError(
                f"adapter.lora_target_modules: '{target}' names a module of {arch} that LoRA cannot "
                f"adapt: {why}; linear modules of this model: {available} (or use 'all-linear')"
            )
        raise ModelError(
            f"adapter.lora_target_modules: '{target}' matches no module of {arch}; linear modules "
            f"of this model: {available} (or use 'all-linear')"
        )


def check_modules_to_save(model: nn.Module, to_save: list[str], targets: list[str] | str) -> None:
    names = [name for name, _ in model.named_modules() if name]
    for module_name in to_save:
        if not any(_matches(name, module_name) for name in names):
            top = sorted({name.rsplit(".", 1)[-1] for name in names if "layers." not in name})
            raise ModelError(
                f"adapter.lora_modules_to_save: '{module_name}' matches no module of "
                f"{type(model).__name__}; modules outside the decoder layers: {', '.join(top)}"
            )
        if isinstance(targets, list) and module_name in targets:
            raise ModelError(
                f"adapter: '{module_name}' is in both lora_target_modules and lora_modules_to_save; "
                "a module is either adapted (LoRA) or trained in full (modules_to_save), not both"
            )


def touches_tied_embedding(model: nn.Module, names: list[str]) -> bool:
    """Whether ``model`` ties its output head to its input embedding and ``names`` reach either."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return False
    embedding, head = get_in(), get_out()
    if embedding is None or head is None or embedding.weight is not head.weight:
        return False
    return any(
        module is embedding or module is head
        for name, module in model.named_modules()
        if name and any(_matches(name, target) for target in names)
    )


def is_lora(model: nn.Module) -> bool:
    return isinstance(model, PeftModel)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module inside a ``torch.compile`` wrapper (its parameter names lack ``_orig_mod``)."""
    return getattr(model, "_orig_mod", model)


def adapters_off(model: nn.Module) -> Callable[[], AbstractContextManager]:
    """A context manager factory that switches every LoRA adapter of ``model`` off and back on:
    every PEFT tuner layer (hone's expert LoRA, :class:`hone.models.experts.lora.HoneExpertsLora`,
    is a PEFT ``ParamWrapper`` that falls back to PEFT's disabled forward) and ``modules_to_save``
    copy. Preference objectives compute their reference log-probabilities inside it, once a step.

    It does what ``PeftModel.disable_adapter`` does for LoRA (each layer's public
    ``enable_adapters(False)``, then ``True`` for the layers that were on), without the model
    status that method builds first (``get_model_status`` walks every module and formats their
    reprs) and without walking the model again each time: on a 36-layer model with LoRA on q, k,
    v and o, 4.0 ms of host time per switch instead of PEFT's 21.9 (this repo's 2-core CPU
    machine), once every DPO step, whose GPU waits on its host (benchmarks/2026-11-28-h200-dpo.md).
    The layers are listed once, at the first switch (the model is complete by then)."""
    if not isinstance(model, PeftModel):
        raise ModelError(f"{type(model).__name__} has no adapter to switch off (adapter.type: none)")
    if any(c.is_prompt_learning or c.is_adaption_prompt for c in model.peft_config.values()):
        return model.disable_adapter  # not LoRA-like: PEFT swaps methods instead of flags
    return _AdapterSwitch(model).off


class _AdapterSwitch:
    """The tuner layers of one PEFT model, switched off and back as :func:`adapters_off` says."""

    def __init__(self, model: PeftModel):
        self.model = model
        self.layers: list[nn.Module] | None = None

    @contextmanager
    def off(self) -> Iterator[None]:
        if self.layers is None:
            self.layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer | AuxiliaryTrainingWrapper)]
        on = [layer for layer in self.layers if not layer.disable_adapters]
        for layer in on:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in on:
                layer.enable_adapters(True)
