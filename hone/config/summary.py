"""The few lines ``hone validate`` prints for a valid config: what will be trained, on what,
for how long, and where it goes.

The full resolved config (every default filled in) is a hundred lines; a user checking a file
wants the verdict and the choices that matter, so that is the default and ``--verbose`` prints
the rest. Reads the validated config only: nothing is loaded.
"""

from hone.config.root import HoneConfig


def _model(cfg: HoneConfig, experts_format: str | None) -> str:
    model = cfg.model
    if model.preset is not None:
        text = f"preset {model.preset} (random weights)"
        if model.preset_overrides:
            text += f", {len(model.preset_overrides)} override{'s' if len(model.preset_overrides) != 1 else ''}"
    else:
        text = str(model.path)
    text += f", {model.dtype}"
    if model.quantize == "mxfp4":
        text += ", experts quantized to mxfp4 (attention and dense layers in the dtype)"
    elif model.quantize != "none":
        text += f", quantized {model.quantize}"
    if experts_format is not None:
        text += f", {experts_format}"
    return text


def _adapter(cfg: HoneConfig) -> str:
    adapter = cfg.adapter
    if not adapter.is_lora:
        return "full fine-tune (every weight trained)"
    targets = adapter.lora_target_modules
    return f"LoRA r={adapter.lora_r} alpha={adapter.lora_alpha:g} on {targets if isinstance(targets, str) else ','.join(targets)}"


def _data(cfg: HoneConfig) -> str:
    data = cfg.data
    sets = data.datasets
    first = f"{sets[0].path} ({sets[0].type})"
    text = first if len(sets) == 1 else f"{len(sets)} datasets: {first}, ..."
    text += f"; sequence_len {data.sequence_len}"
    text += ", packed" if data.sample_packing else ""
    if data.val_set_size:
        text += f", {data.val_set_size:.0%} held out for eval"
    if data.test_datasets:
        text += f", {len(data.test_datasets)} eval dataset{'s' if len(data.test_datasets) != 1 else ''}"
    return text


def _training(cfg: HoneConfig) -> str:
    training, optimizer = cfg.training, cfg.optimizer
    if training.max_steps:
        length = f"{training.max_steps} step{'s' if training.max_steps != 1 else ''}"
    else:
        epochs = training.num_epochs or 1
        length = f"{epochs:g} epoch{'s' if epochs != 1 else ''}"
    batch = f"micro-batch {training.micro_batch_size}"
    if training.gradient_accumulation_steps > 1:
        batch += f" x {training.gradient_accumulation_steps} accumulated"
    if training.is_preference:
        batch += " pair" if training.micro_batch_size == 1 else " pairs"
    text = f"{length}, {batch}; {optimizer.name} lr {optimizer.learning_rate:g} {optimizer.lr_scheduler}"
    if training.is_preference:
        pref = training.preference
        reference = {None: "reference-free", "adapter_disabled": "reference: the adapter switched off"}.get(
            cfg.preference_reference, "reference: precomputed before the first step"
        )
        text = f"{training.objective} (beta {pref.beta:g}, {reference}); " + text
    every = [f"{what} every {n}" for what, n in (("eval", training.eval_steps), ("save", training.save_steps)) if n]
    return text + (f"; {', '.join(every)} steps" if every else "")


def summarize(cfg: HoneConfig, experts_format: str | None = None) -> list[str]:
    """``  model     ...`` lines: model, adapter, data, training, output. ``experts_format``: what
    the model directory's config.json says of its experts' storage (``experts in MXFP4 as shipped``),
    which the caller reads (the config alone does not know it)."""
    rows = [
        ("model", _model(cfg, experts_format)),
        ("adapter", _adapter(cfg)),
        ("data", _data(cfg)),
        ("training", _training(cfg)),
        ("output", str(cfg.training.output_dir)),
    ]
    return [f"  {name:<9} {value}" for name, value in rows]
