"""The training loop: batch shape, length, evaluation, checkpoints, outputs."""

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from hone.config.base import Section

#: ``training.objective`` values; every one but ``sft`` trains on preference pairs.
OBJECTIVES: tuple[str, ...] = ("sft", "dpo", "ipo", "orpo")


class PreferenceConfig(Section):
    """The preference objectives' settings (``training.objective: dpo | ipo | orpo``), named as TRL names them."""

    beta: float = Field(0.1, gt=0)
    """DPO's and IPO's beta (the strength of the pull towards the reference); ORPO's lambda
    (the weight of its odds-ratio term beside the NLL)."""

    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """DPO only: conservative DPO's assumed probability that a pair's preference is flipped."""

    reference: Literal["auto", "adapter_disabled", "precomputed"] = "auto"
    """Where DPO's and IPO's reference log-probabilities come from. ``adapter_disabled``: the
    same model with its LoRA adapter(s) switched off, in the same micro-batch (no second copy);
    ``precomputed``: one pass over the pairs with the initial weights before the first step,
    kept with the run; ``auto``: ``precomputed`` for a full fine-tune and for LoRA over several
    epochs (``num_epochs`` above 1: the reference computed once instead of every epoch), else
    ``adapter_disabled``. ORPO has no reference."""

    share_prompt: bool | Literal["auto"] = "auto"
    """Compute a pair's prompt once: its row holds the prompt, then the chosen and the rejected
    completion, each attending to the prompt but not to the other (a tree mask), instead of the
    prompt twice. The same log-probabilities (only rounding differs) from fewer tokens: a pair of a
    512-token prompt and two 768-token completions is 2,049 tokens instead of 2,560. ``auto``: on
    wherever the attention can take that mask (sdpa or flex_attention, every layer attending to
    the whole row); ``true`` stops where it cannot; ``false``: the prompt in both sequences."""


class TrainingConfig(Section):
    """Batch shape, run length, evaluation, checkpoints and the run directory."""

    micro_batch_size: int = Field(1, ge=1)
    """Samples per forward/backward pass."""

    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step. The loss is normalised by the trained tokens of the
    whole window, so ``4 x 1`` and ``1 x 4`` give the same update."""

    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to run. Set this or ``num_epochs``."""

    num_epochs: float | None = Field(None, gt=0)
    """Passes over the training data (fractions allowed). Default 1 when ``max_steps`` is unset."""

    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; ``null`` disables clipping."""

    eval_steps: int | None = Field(None, ge=1)
    """Evaluate every N optimizer steps (and always at the end when there is eval data)."""

    evals_per_epoch: int | None = Field(None, ge=1)
    """Evaluate N times per epoch, evenly spaced (instead of ``eval_steps``): after step
    ``ceil(k * steps_per_epoch / N)`` of each epoch for ``k = 1..N``, so the last one closes the
    epoch; every step when N is at least the steps per epoch."""

    save_steps: int | None = Field(None, ge=1)
    """Write a resumable checkpoint every N optimizer steps (and always at the end)."""

    saves_per_epoch: int | None = Field(None, ge=1)
    """Write a checkpoint N times per epoch, evenly spaced (instead of ``save_steps``), at the
    same points as ``evals_per_epoch``."""

    save_total_limit: int = Field(2, ge=1)
    """Keep only the newest K checkpoints."""

    resume: Literal["latest"] | Path | None = None
    """Continue from the newest checkpoint in ``output_dir`` (``latest``) or from a path."""

    seed: int = 42
    """Seeds weight init of new modules, data order, validation split and dropout."""

    output_dir: Path = Path("runs/hone")
    """Run directory: config, metrics, checkpoints, final adapter or model."""

    overwrite_output_dir: bool = False
    """Start over in an ``output_dir`` that holds an earlier run (finished or not): its files are
    removed first (``hone train --overwrite`` sets this). Only a directory holding nothing but
    what ``hone train`` writes is cleared; anything else there is refused, never deleted."""

    max_consecutive_nonfinite: int = Field(5, ge=1)
    """Skipped steps (non-finite loss or gradient) in a row before the run stops."""

    objective: Literal["sft", "dpo", "ipo", "orpo"] = "sft"
    """What the run minimises: ``sft`` the language-modelling loss on rows; ``dpo`` (sigmoid
    loss), ``ipo`` or ``orpo`` (reference-free, odds ratio beside the chosen NLL) on preference
    pairs (datasets of type ``preference``). A preference micro-batch holds
    ``micro_batch_size`` pairs."""

    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    """Settings of the preference objectives (only with ``objective: dpo | ipo | orpo``)."""

    @property
    def is_preference(self) -> bool:
        """Whether the run trains a preference objective on pairs."""
        return self.objective != "sft"

    @model_validator(mode="after")
    def _preference_keys_fit(self) -> "TrainingConfig":
        # keys that differ from their defaults (a dumped config writes every key back at its default)
        default = PreferenceConfig()
        written = sorted(k for k in PreferenceConfig.model_fields if getattr(self.preference, k) != getattr(default, k))
        if self.objective == "sft" and written:
            raise ValueError(
                f"training.preference.{written[0]} is set but training.objective is sft: set training.objective to "
                "dpo, ipo or orpo, or remove training.preference"
            )
        if self.objective in ("ipo", "orpo") and self.preference.label_smoothing:
            raise ValueError(
                f"training.preference.label_smoothing: {self.preference.label_smoothing} applies to dpo only, "
                f"but training.objective is {self.objective}: remove it or set it to 0"
            )
        if self.objective == "orpo" and self.preference.reference != "auto":
            raise ValueError(
                f"training.preference.reference: {self.preference.reference} does not apply to orpo, which has no "
                "reference model: remove it"
            )
        return self

    @model_validator(mode="after")
    def _one_length(self) -> "TrainingConfig":
        if self.max_steps is not None and self.num_epochs is not None:
            raise ValueError(
                "set either training.max_steps or training.num_epochs, not both "
                f"(got max_steps={self.max_steps}, num_epochs={self.num_epochs})"
            )
        if self.overwrite_output_dir and self.resume is not None:
            raise ValueError(
                f"training.overwrite_output_dir: true starts over, training.resume: {self.resume} continues a run: "
                "set one of them, not both (to start over with a config that resumes: --overwrite --set training.resume=null)"
            )
        return self

    @model_validator(mode="after")
    def _one_cadence(self) -> "TrainingConfig":
        for steps, per_epoch in (("save_steps", "saves_per_epoch"), ("eval_steps", "evals_per_epoch")):
            if getattr(self, steps) is not None and getattr(self, per_epoch) is not None:
                raise ValueError(
                    f"set either training.{steps} or training.{per_epoch}, not both "
                    f"(got {steps}={getattr(self, steps)}, {per_epoch}={getattr(self, per_epoch)})"
                )
        return self

    @property
    def epochs(self) -> float | None:
        """Epochs to run when the length is given in epochs (the default is one)."""
        if self.max_steps is not None:
            return None
        return self.num_epochs if self.num_epochs is not None else 1.0

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps
