"""``hone merge``: fold a LoRA adapter into its base weights and save a plain model.

The merge runs in float32 on a base identical to the one training saw (so a bf16 base is
rounded once, at the end, not twice), then the merged weights are stored in the run's
``model.dtype``. This needs the whole model in float32 memory on ``device`` (CPU by default).

A QLoRA run (``model.quantize: nf4``) merges into the *dequantized* base: the base is read from
``model.path`` (or the preset) in ``model.dtype``, each weight training held in 4 bits is
quantized and dequantized exactly as training did (:func:`hone.models.nf4.nf4_roundtrip_`),
and the adapter is added to that. The adapter learned to correct the 4-bit weights it saw, so
this merged model computes what the trained model computed; merging into the original bf16
weights instead would apply those corrections to weights they were not learned for. The 4-bit
weights themselves are never merged into (a 4-bit matrix cannot hold the sum). A base whose
experts are MXFP4 (a gpt-oss checkpoint as shipped, or ``model.quantize: mxfp4``) merges the
same way: :func:`hone.export.load.load_for_inference` dequantizes the experts to exactly the
values training computed with, and the merged model is an ordinary one (no
``quantization_config``), in the run's ``model.dtype``.
"""

from pathlib import Path

import torch

from hone.atomic import atomic_directory
from hone.export.load import load_for_inference
from hone.export.run_dir import read_run
from hone.models.errors import ModelError
from hone.models.loader import cast_parameters
from hone.models.precision import DTYPES


def merge_adapter(run_dir: Path, out_dir: Path, device: torch.device | str = "cpu") -> Path:
    """Write base + LoRA of ``run_dir`` as a full safetensors model (with tokenizer) to ``out_dir``."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    run = read_run(run_dir)
    if not run.is_adapter:
        raise ModelError(
            f"'{run_dir}' is a full fine-tune: {run.final} already holds the full model, there is "
            "no adapter to merge (point model.path at it directly)"
        )
    resolved = out_dir.resolve()
    if resolved == run_dir.resolve() or resolved.is_relative_to(run.final.resolve()):
        raise ModelError(f"--output '{out_dir}' would overwrite the run itself; choose a new directory")
    model, tokenizer = load_for_inference(run_dir, device=device, dtype="float32")
    merged = model.merge_and_unload()
    dtype = DTYPES[run.cfg.model.dtype]
    cast_parameters(merged, dtype)
    merged.config.dtype = dtype
    with atomic_directory(out_dir) as tmp:
        merged.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    return out_dir
