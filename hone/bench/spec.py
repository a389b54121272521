"""The benchmark spec: one workload, several conditions, each run in its own process."""

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from hone.config.base import Section
from hone.config.errors import ConfigError, ConfigIssue, issues_from_validation
from hone.config.model import Dtype, PresetInit, PresetName


class BenchAdapter(Section):
    """The adapter both sides train (the reference builds the same LoRA through PEFT)."""

    type: Literal["lora", "none"] = "lora"
    lora_r: int = Field(16, gt=0)
    lora_alpha: float = Field(32.0, gt=0)
    lora_target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class Workload(Section):
    """What is trained: the same on every condition so the rows compare."""

    preset: PresetName | None = None
    """Random-init architecture (no weights needed)."""

    path: Path | None = None
    """Or a local model directory."""

    layers: int | None = Field(None, ge=1)
    """Depth override (e.g. 8 layers of qwen3-30b-a3b fit one card)."""

    preset_init: PresetInit = "transformers"
    """How the preset's random weights are drawn (``model.preset_init``): ``sharp_attention`` for
    rows whose speed depends on how the router spreads tokens (expert parallelism); every
    condition, the reference included, gets the same weights."""

    sequence_len: int = Field(2048, ge=8)
    micro_batch_size: int = Field(1, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    dtype: Dtype = "bfloat16"
    adapter: BenchAdapter = Field(default_factory=BenchAdapter)
    data: Literal["random", "lengths", "pairs"] = "random"
    """``random``: full-length rows of random ids, every token trained. ``lengths``: documents
    of random ids with log-normal lengths (see ``length_median``), to compare batching
    (padded vs ``data.sample_packing``) by trained tokens per second. ``pairs``: preference
    pairs of random words (``prompt_len``, ``completion_len``) trained with ``objective``;
    ``micro_batch_size`` counts pairs."""

    prompt_len: int = Field(512, ge=2)
    """``data: pairs``: prompt tokens of every pair (BOS included)."""

    completion_len: int = Field(768, ge=2)
    """``data: pairs``: tokens of the chosen and of the rejected completion (EOS included)."""

    objective: Literal["dpo", "ipo", "orpo"] = "dpo"
    """``data: pairs``: the preference objective hone trains (``training.objective``)."""

    length_median: int = Field(300, ge=8)
    """``data: lengths``: median document length in tokens."""

    length_sigma: float = Field(1.0, gt=0)
    """``data: lengths``: sigma of the log-normal lengths (1.0: a tail to ~10x the median)."""

    documents: int = Field(4000, ge=1)
    """``data: lengths``: documents in the dataset (steps stop at the spec's step count)."""

    @model_validator(mode="after")
    def _one_model(self) -> "Workload":
        if (self.preset is None) == (self.path is None):
            raise ValueError("set exactly one of workload.preset or workload.path")
        if self.layers is not None and self.preset is None:
            raise ValueError("workload.layers only applies to presets")
        if self.preset_init != "transformers" and self.preset is None:
            raise ValueError(f"workload.preset_init: {self.preset_init} only applies to presets (a directory's weights are read)")
        return self

    @model_validator(mode="after")
    def _pairs_fit(self) -> "Workload":
        if self.data == "pairs" and self.prompt_len + self.completion_len > self.sequence_len:
            raise ValueError(
                f"data: pairs: prompt_len {self.prompt_len} + completion_len {self.completion_len} is beyond "
                f"sequence_len {self.sequence_len} (each of a pair's two sequences must fit)"
            )
        return self

    @property
    def pairs_per_step(self) -> int:
        """``data: pairs``: pairs in one optimizer step."""
        return self.micro_batch_size * self.gradient_accumulation_steps

    @property
    def tokens_per_step(self) -> int:
        """Tokens one step runs through the model (pairs: both sequences of every pair)."""
        if self.data == "pairs":
            return 2 * (self.prompt_len + self.completion_len) * self.pairs_per_step
        return self.sequence_len * self.micro_batch_size * self.gradient_accumulation_steps


class Condition(Section):
    """One row of the table: hone with config overrides, or the built-in reference."""

    name: str
    reference: Literal["hf-peft", "hf-peft-qlora", "trl-dpo"] | None = None
    """Run the plain transformers + PEFT step instead of hone; ``hf-peft-qlora``: the same on a
    bitsandbytes 4-bit base (nf4, double quantization; see :mod:`hone.bench.reference`);
    ``trl-dpo``: TRL's DPOTrainer on the ``data: pairs`` workload (DPO or IPO), through the peer
    script benchmarks/peer/trl_dpo.py (needs ``trl``: pip install 'hone[dev]')."""

    gradient_checkpointing: bool = False
    """Reference only: non-reentrant checkpointing of every decoder layer."""

    compile: bool = False
    """Reference only: ``torch.compile`` of the whole model (``trl-dpo``: the Trainer's ``torch_compile``)."""

    precompute_ref: bool = False
    """``trl-dpo`` only: TRL's ``precompute_ref_log_probs`` (the reference log-probs computed
    before training, not timed)."""

    set: dict[str, Any] = Field(default_factory=dict)
    """hone only: config overrides as dotted keys, e.g. ``memory.activation_checkpointing: full``."""

    nproc: int = Field(1, ge=1)
    """hone only: processes (GPUs of this host) the row trains on, started by torchrun; the row
    reports per-GPU and total tok/s, the peak memory of the fullest rank, and its scaling against
    the spec's one-process hone row."""

    compile_cache: Literal["cold", "shared"] = "cold"
    """Inductor's and Triton's caches for this row: ``cold`` starts from an empty directory (the first-step
    time is a true cold start); ``shared`` uses one directory for all ``shared`` rows of this
    bench run, so a row repeating an earlier row's config measures a second run's start."""

    @model_validator(mode="after")
    def _options_match_kind(self) -> "Condition":
        if self.reference is None and (self.explicitly_set("gradient_checkpointing") or self.explicitly_set("compile")):
            raise ValueError(
                f"condition '{self.name}': gradient_checkpointing/compile are reference options; "
                "for hone use set: {memory.activation_checkpointing: full}"
            )
        if self.reference is not None and self.nproc > 1:
            raise ValueError(f"condition '{self.name}': nproc applies to hone conditions, not to the reference")
        if self.reference is not None and self.set:
            raise ValueError(f"condition '{self.name}': 'set' applies to hone conditions, not to the reference")
        if self.precompute_ref and self.reference != "trl-dpo":
            raise ValueError(f"condition '{self.name}': precompute_ref applies to reference: trl-dpo only")
        return self

    @property
    def overrides(self) -> list[str]:
        """``set`` as ``--set``-style strings (values dumped as YAML)."""
        return [
            f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
            for key, value in self.set.items()
        ]


class LongestSearch(Section):
    """``kind: longest``: how the longest sequence is searched for (docs/long-context.md)."""

    start: int = Field(16384, ge=8)
    """The first length tried; doubled while it completes, then bisected."""

    max: int = Field(524288, ge=8)
    """No length beyond this is tried (the search stops there when it completes)."""

    granularity: int = Field(8192, ge=8)
    """The bisection stops when the last completed and the first failed length are this close;
    every length tried is a multiple of it (``start`` and ``max`` excepted)."""

    steps: int = Field(3, ge=2)
    """Optimizer steps a length must complete: the first is the warm-up (compile), the others
    are timed for the tok/s column."""

    @model_validator(mode="after")
    def _ordered(self) -> "LongestSearch":
        if self.start > self.max:
            raise ValueError(f"search.start {self.start} is beyond search.max {self.max}")
        return self


class BenchSpec(Section):
    """A benchmark: one workload, conditions, and how to time them."""

    name: str = "bench"
    kind: Literal["table", "longest", "lengths"] = "table"
    """``table``: every condition at ``workload.sequence_len``. ``longest``: for every condition,
    the longest sequence that completes ``search.steps`` optimizer steps (doubling from
    ``search.start``, then bisecting to ``search.granularity``), each length in its own process,
    with tok/s and peak GPU and host memory per length. ``lengths``: every condition at each of
    ``lengths`` (a tok/s and memory table by length)."""

    search: LongestSearch = Field(default_factory=LongestSearch)
    """``kind: longest``: the search."""

    lengths: list[int] = Field(default_factory=list)
    """``kind: lengths``: the sequence lengths, each run in its own process per condition."""

    workload: Workload
    conditions: list[Condition] = Field(min_length=1)
    warmup_steps: int = Field(4, ge=0)
    """Steps run before timing starts (compilation, autotuning, allocator warm-up). 0 times the
    first step too, compilation included: for steps of many minutes, where one optimizer step is
    all a device session affords (the longest sequences)."""

    timed_steps: int = Field(12, ge=1)
    """Steps whose times give the median, min and max."""

    replicates: int = Field(1, ge=1)
    """Fresh processes per condition."""

    peak_tflops: float = Field(989.0, gt=0)
    """Dense bf16 peak of the card for MFU (989 = H100 SXM)."""

    timeout_s: float = Field(1200.0, gt=0)
    """A replicate running longer than this becomes a failure row."""

    seed: int = 0

    @model_validator(mode="after")
    def _lengths_are_hone_only(self) -> "BenchSpec":
        refs = [c.name for c in self.conditions if c.reference not in (None, "trl-dpo")]
        trl = [c.name for c in self.conditions if c.reference == "trl-dpo"]
        if self.workload.data == "pairs" and refs:
            raise ValueError(
                f"workload.data 'pairs' trains a preference objective, which the reference step (the language-modelling "
                f"loss) does not; remove the reference condition(s) {', '.join(refs)}, or use reference: trl-dpo"
            )
        if trl and self.workload.adapter.type != "lora":
            raise ValueError(f"reference: trl-dpo (condition(s) {', '.join(trl)}) trains a LoRA: set workload.adapter.type: lora")
        if trl and (self.workload.data != "pairs" or self.workload.objective == "orpo"):
            raise ValueError(
                f"reference: trl-dpo (condition(s) {', '.join(trl)}) trains DPO or IPO on preference pairs: "
                f"set workload.data: pairs and objective: dpo or ipo (got data: {self.workload.data}, "
                f"objective: {self.workload.objective})"
            )
        if self.workload.data == "lengths" and refs:
            raise ValueError(
                f"workload.data 'lengths' varies document lengths, which the reference step (full-length "
                f"random rows) does not; remove the reference condition(s) {', '.join(refs)} or use data: random"
            )
        return self

    @model_validator(mode="after")
    def _kind_has_what_it_needs(self) -> "BenchSpec":
        if self.kind == "lengths" and not self.lengths:
            raise ValueError("kind: lengths needs lengths: a list of sequence lengths, e.g. [8192, 65536]")
        if self.lengths and self.kind != "lengths":
            raise ValueError(f"lengths is only read by kind: lengths (this spec is kind: {self.kind})")
        if any(n < 8 for n in self.lengths):
            raise ValueError(f"lengths must be at least 8 tokens each, got {self.lengths}")
        if self.kind != "table" and self.workload.data != "random":
            raise ValueError(f"kind: {self.kind} varies the row length: use workload.data: random (full-length rows)")
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> "BenchSpec":
        names = [c.name for c in self.conditions]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"condition names must be unique; repeated: {', '.join(dupes)}")
        return self


def load_spec(path: Path, overrides: list[str] | None = None, only: list[str] | None = None) -> BenchSpec:
    """Read and validate a spec file; problems are reported like config problems. ``only``: run
    these conditions alone (:func:`select_conditions`)."""
    from hone.config.loader import apply_overrides

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError([ConfigIssue("", f"bench spec not found: {path}")], str(path)) from None
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigIssue("", f"malformed YAML: {exc}")], str(path)) from None
    if overrides:
        raw = apply_overrides(raw, overrides)
    spec = parse_spec(raw, str(path))
    return select_conditions(spec, only, str(path)) if only else spec


def select_conditions(spec: BenchSpec, only: list[str], source: str = "spec") -> BenchSpec:
    """``spec`` with only the conditions ``only`` names, in the spec's order: each item a
    condition's exact name or its number in the spec (1 is the first), so that a benchmark file
    can give the committed spec and the rows it ran (``hone bench SPEC --only 2 --only 5``)
    instead of a cut-down copy. An unknown item is an error that lists the conditions."""
    names = [c.name for c in spec.conditions]
    chosen: set[int] = set()
    unknown = []
    for item in only:
        text = item.strip()
        if text.isdigit() and 1 <= int(text) <= len(names):
            chosen.add(int(text) - 1)
        elif text in names:
            chosen.add(names.index(text))
        else:
            unknown.append(item)
    if unknown:
        listed = "; ".join(f"{i + 1}: {name}" for i, name in enumerate(names))
        what = f"--only {unknown[0]!r} is neither a condition's name nor its number; the spec has {listed}"
        raise ConfigError([ConfigIssue("conditions", what)], source)
    return spec.model_copy(update={"conditions": [c for i, c in enumerate(spec.conditions) if i in chosen]})


def parse_spec(raw: Any, source: str = "spec") -> BenchSpec:
    try:
        return BenchSpec.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(issues_from_validation(BenchSpec, exc, {}), source) from None
