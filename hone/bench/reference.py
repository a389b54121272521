"""The reference condition: the transformers + PEFT step a user would write by hand.

Deliberately plain: the model from ``from_config`` with sdpa attention (transformers' default
where a model has none), PEFT ``get_peft_model``,
optional non-reentrant checkpointing and whole-model ``torch.compile``, fused AdamW, and the
model's own loss (``labels=input_ids``). Every hone row is reported as a ratio to this.

``hf-peft-qlora`` is the common QLoRA recipe (transformers + PEFT + bitsandbytes): every linear
layer but the head in bitsandbytes 4-bit (``BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16)``),
then PEFT's ``prepare_model_for_kbit_training`` (norms, embedding and head upcast to float32),
then LoRA. A preset has no files to ``from_pretrained`` with a quantization config, so the
random model is drawn the way ``from_pretrained`` fills a checkpoint's tensors: a meta-device
skeleton materialised on the GPU one module at a time (:mod:`hone.models.materialize`), each
linear layer but the head swapped, as soon as it is drawn, for a ``bnb.nn.Linear4bit`` whose
``Params4bit`` weight bitsandbytes quantizes where the weight lies (transformers' bitsandbytes
integration: ``Params4bit(value, **old.__dict__).to(value.device)``). So the bf16 model never
exists whole, and the row starts in seconds rather than after minutes of CPU initialisation.
"""

import time
from collections.abc import Callable

import torch

from hone.bench.spec import Condition, Workload


def build_reference_model(config: object, dtype: str, device: torch.device, seed: int) -> torch.nn.Module:
    """The model as a user builds it: ``from_config`` on the device, sdpa attention, or
    transformers' own default for a model that declares no sdpa support (gpt_oss: eager, the
    attention that computes its sinks on every device)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        try:
            return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
        except ValueError:  # "does not support an attention implementation through ... sdpa"
            return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))


def build_qlora_reference_model(config: object, dtype: str, device: torch.device, seed: int) -> torch.nn.Module:
    """The QLoRA base as transformers + bitsandbytes load it (nf4, double quantization, ``dtype``
    compute), prepared by PEFT's ``prepare_model_for_kbit_training`` (without its checkpointing:
    the condition decides that, as for the plain reference)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        from hone.models.errors import ModelError

        raise ModelError(
            "bench condition reference: hf-peft-qlora needs the Python package 'bitsandbytes' (the "
            "QLoRA reference stack): pip install 'hone[bench-qlora]' (or pip install bitsandbytes)"
        ) from None
    from peft import prepare_model_for_kbit_training

    compute = getattr(torch, dtype)
    model = build_quantized_reference_base(config, dtype, device, seed, lambda linear: bnb_linear4bit(bnb, linear, compute))
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def build_quantized_reference_base(
    config: object, dtype: str, device: torch.device, seed: int, quantize: Callable[[torch.nn.Linear], torch.nn.Module]
) -> torch.nn.Module:
    """The reference model (sdpa attention, ``dtype``) drawn on ``device`` one module at a time,
    each linear layer but the head replaced by ``quantize(layer)`` as soon as it is drawn."""
    from hone.models.materialize import build_skeleton, materialize

    skeleton = build_skeleton(config, getattr(torch, dtype), attn_implementation="sdpa")
    head = skeleton.get_output_embeddings()

    def replace(module: torch.nn.Module) -> torch.nn.Module | None:
        return quantize(module) if isinstance(module, torch.nn.Linear) and module is not head else None

    torch.manual_seed(seed)
    return materialize(skeleton, device, replace)


def bnb_linear4bit(bnb, linear: torch.nn.Linear, compute: torch.dtype) -> torch.nn.Module:
    """``linear`` as transformers' bitsandbytes integration holds it: a ``Linear4bit`` built on the
    meta device (``replace_with_bnb_linear``) whose weight becomes ``Params4bit`` and is quantized
    where it lies (``Bnb4bitQuantize``)."""
    with torch.device("meta"):
        quantized = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=compute,
            compress_statistics=True,
            quant_type="nf4",
        )
    weight = linear.weight.data
    quantized.weight = bnb.nn.Params4bit(weight, requires_grad=False, **quantized.weight.__dict__).to(weight.device)
    if linear.bias is not None:
        quantized.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
    quantized.requires_grad_(False)
    return quantized


def run_reference(
    config: object,
    workload: Workload,
    condition: Condition,
    batches: list[torch.Tensor],
    steps: int,
    device: torch.device,
    seed: int,
    on_step: Callable[[int, float, float], None],
) -> None:
    """Train ``steps`` optimizer steps; ``on_step(step, seconds, loss)`` after each one."""
    if condition.reference == "hf-peft-qlora":
        model = build_qlora_reference_model(config, workload.dtype, device, seed)
    else:
        model = build_reference_model(config, workload.dtype, device, seed)
    if workload.preset is not None:
        from hone.models.preset_init import apply_preset_init

        apply_preset_init(model, workload.preset_init)
    full_ft = workload.adapter.type == "none"
    if not full_ft:
        from peft import LoraConfig, get_peft_model

        from hone.models.adapters import split_expert_targets

        # experts' 3-D parameters go to PEFT's target_parameters (LoRA on the transformers
        # default experts), everything else to target_modules, as a plain PEFT user writes it
        modules, parameters = split_expert_targets(model, list(workload.adapter.lora_target_modules))
        lora = LoraConfig(
            r=workload.adapter.lora_r,
            lora_alpha=workload.adapter.lora_alpha,
            lora_dropout=0.0,
            target_modules=modules or None,
            target_parameters=parameters or None,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    if condition.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not full_ft:
            model.enable_input_require_grads()
    model.train()
    if condition.compile:
        model = torch.compile(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    accum = workload.gradient_accumulation_steps
    for step in range(steps):
        _sync(device)
        start = time.perf_counter()
        for micro in range(accum):
            ids = batches[(step * accum + micro) % len(batches)]
            loss = model(input_ids=ids, labels=ids).loss / accum
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        on_step(step, time.perf_counter() - start, float(loss.detach()) * accum)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
