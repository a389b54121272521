"""The names of what ``hone train`` writes into ``training.output_dir``, in one place.

Why a leaf module: the trainer writes these files, the trackers and the plan record name them,
``hone generate`` / ``merge`` / ``chat`` read them back, and the tests look for them. Defined
once here, below every package that uses them, a renamed file cannot leave a reader behind.
Names inside a checkpoint directory belong to :mod:`hone.train.checkpoint_layout`.
"""

CONFIG_FILE = "config.yml"
"""The resolved config of the run (every default filled in)."""

FINAL_DIR = "final"
"""The final PEFT adapter or ``save_pretrained`` model; present only once the run has finished."""

CHECKPOINTS_DIR = "checkpoints"
"""``checkpoints/step-<N>``: what a killed run resumes from."""

METRICS_FILE = "metrics.jsonl"
"""One JSON row per logged train step and per eval."""

PLOT_FILE = "loss.png"
TENSORBOARD_DIR = "tensorboard"

OPTIMIZATIONS_FILE = "optimizations.json"
"""The plan's record: applied and skipped transforms, with the compile counts once training ends."""

REFERENCE_FILE = "reference_logps.safetensors"
"""DPO/IPO of a full fine-tune: the reference log-probs of every pair, computed once with the
initial weights before the first step; a resumed run reads them back."""

LOCK_FILE = ".hone.lock"
"""Held (``flock``) by the one ``hone train`` writing the directory; names its pid and host."""
