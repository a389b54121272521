"""Where the training text comes from and how it becomes token ids.

Each dataset entry is one of four formats, selected by ``type`` (a discriminated union, so a
key that belongs to another format is an error instead of being ignored).
"""

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from hone.config.base import Section

FileFormat = Literal["auto", "jsonl", "json", "parquet", "csv", "arrow"]
ChatRole = Literal["system", "user", "assistant", "tool"]

#: File suffix -> ``datasets`` builder name, used when ``file_format`` is ``auto``.
SUFFIX_FORMATS: dict[str, str] = {
    ".jsonl": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}


#: ``owner/name`` with the characters the Hub allows, then an optional ``@revision``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(?:@[\w./-]+)?$")


def looks_like_hub_id(path: str | Path) -> bool:
    """Whether ``path`` has the shape of a hub dataset id (``owner/name[@revision]``) and no
    data-file suffix. Pure: whether a local file of that name exists is decided later."""
    text = str(path)
    return _HUB_ID.match(text) is not None and Path(text.split("@")[0]).suffix.lower() not in SUFFIX_FORMATS


class _DatasetBase(Section):
    path: Path
    """Local data file (jsonl, json, parquet, csv or arrow). Relative paths are from the CWD.
    A hub dataset id (``tatsu-lab/alpaca``, ``Org/Name@revision``) reads the dataset's files from
    the local Hugging Face caches (hub snapshot, or the ``datasets`` Arrow cache; never
    downloaded); ``hf://datasets/Org/Name[@revision]/file.jsonl`` reads one file of a dataset
    repo from the hub cache. See docs/datasets.md."""

    file_format: FileFormat = "auto"
    """File format; ``auto`` picks it from the file suffix (for a hub id: from its files)."""

    split: str | None = None
    """For a hub dataset id: the split to read (default ``train``). A file is read whole."""

    weight: float = Field(1.0, gt=0)
    """Mixing weight: each row is used ``weight`` times on average (0.5 keeps a seeded random
    half, 2.0 repeats every row twice, 1.5 repeats a seeded random half)."""

    #: The data files of a hub dataset id, found in the local caches when the data is prepared
    #: (``hone.data.hub_files.with_cached_data_files``), and their format; empty for a file.
    _files: tuple[Path, ...] = PrivateAttr(default=())
    _files_format: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _format_known(self) -> "_DatasetBase":
        hub_id = looks_like_hub_id(self.path)
        if self.file_format == "auto" and self.path.suffix.lower() not in SUFFIX_FORMATS and not hub_id:
            raise ValueError(
                f"cannot tell the file format of '{self.path}' from its suffix: set file_format "
                f"to one of: {', '.join(sorted(set(SUFFIX_FORMATS.values())))} (or give a hub dataset id, owner/name)"
            )
        if self.split is not None and not hub_id:
            raise ValueError(
                f"split: '{self.split}' applies to hub dataset ids (owner/name); the file '{self.path}' is read whole"
            )
        return self

    def with_files(self, files: tuple[Path, ...], file_format: str) -> "_DatasetBase":
        """A copy that reads ``files`` (the cached files of a hub id) in ``file_format``."""
        copy = self.model_copy()
        copy._files, copy._files_format = tuple(files), file_format
        return copy

    @property
    def files(self) -> tuple[Path, ...]:
        """The files to read: the cached files of a hub id once found, else ``path``."""
        return self._files or (self.path,)

    @property
    def resolved_format(self) -> str:
        if self.file_format != "auto":
            return self.file_format
        if self._files_format is not None:
            return self._files_format
        return SUFFIX_FORMATS[self.path.suffix.lower()]


class AlpacaDataset(_DatasetBase):
    """Instruction / optional input / output rows; only the output is trained."""

    type: Literal["alpaca"]
    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"


class ChatDataset(_DatasetBase):
    """Rows holding a list of messages, rendered with a chat template."""

    type: Literal["chat"]
    field_messages: str = "messages"
    field_role: str = "role"
    field_content: str = "content"
    role_map: dict[str, ChatRole] = Field(default_factory=dict)
    """Map source role names to standard ones, e.g. ``{human: user, gpt: assistant}``."""

    train_on: list[ChatRole] = Field(default_factory=lambda: ["assistant"])
    """Roles whose tokens are trained; the rest are context (label -100)."""

    @model_validator(mode="after")
    def _trains_something(self) -> "ChatDataset":
        if not self.train_on:
            raise ValueError("train_on is empty: no token would be trained (e.g. [assistant])")
        return self


class CompletionDataset(_DatasetBase):
    """Raw text; every token is trained."""

    type: Literal["completion"]
    field_text: str = "text"


class PretokenizedDataset(_DatasetBase):
    """Rows of token ids, with optional labels (-100 = not trained)."""

    type: Literal["pretokenized"]
    field_input_ids: str = "input_ids"
    field_labels: str | None = "labels"
    """Column of labels; if the column is absent, every token is trained."""


class PreferenceDataset(_DatasetBase):
    """Pairs of a prompt, a chosen and a rejected completion, for a preference objective
    (DPO, IPO, ORPO). Rows are plain text (three strings) or chat messages: ``chosen`` /
    ``rejected`` conversations that share the prompt turns, or a ``prompt`` message list plus
    the completions' assistant turns (TRL's preference formats; see docs/datasets.md)."""

    type: Literal["preference"]
    field_prompt: str | None = "prompt"
    """Column of the prompt: a string, or a list of messages; optional for chat rows whose
    chosen and rejected conversations carry the prompt turns themselves. ``null``: never read a
    prompt column, take the prompt from the turns chosen and rejected share (for data whose
    prompt column repeats the first user turn as text, e.g. UltraFeedback's)."""

    field_chosen: str = "chosen"
    """Column of the preferred completion: a string, or a list of messages."""

    field_rejected: str = "rejected"
    """Column of the dispreferred completion: a string, or a list of messages."""

    field_role: str = "role"
    """Key of a message's role (chat rows)."""

    field_content: str = "content"
    """Key of a message's text (chat rows)."""

    role_map: dict[str, ChatRole] = Field(default_factory=dict)
    """Map source role names to standard ones, e.g. ``{human: user, gpt: assistant}``."""


DatasetConfig = Annotated[
    AlpacaDataset | ChatDataset | CompletionDataset | PretokenizedDataset | PreferenceDataset,
    Field(discriminator="type"),
]
DATASET_TYPES: tuple[str, ...] = ("alpaca", "chat", "completion", "pretokenized", "preference")
#: Dataset types that train the language-modelling loss (supervised fine-tuning).
SFT_DATASET_TYPES: tuple[str, ...] = ("alpaca", "chat", "completion", "pretokenized")

#: Chat templates shipped with hone (``hone.data.chat_templates`` holds their text), aliases included.
CHAT_TEMPLATE_NAMES: tuple[str, ...] = (
    "chatml",
    "gemma",
    "gemma2",
    "gemma3",
    "llama3",
    "mistral",
    "qwen2",
    "qwen2.5",
    "qwen_25",
    "qwen3",
)


def check_chat_template(value: str | None) -> str | None:
    """A template name hone ships, or Jinja text; anything else is a typo of a name, refused
    here instead of rendering every message to nothing later."""
    if value is None or value.strip().lower() in CHAT_TEMPLATE_NAMES or "{{" in value or "{%" in value:
        return value
    import difflib

    close = difflib.get_close_matches(value.strip().lower(), CHAT_TEMPLATE_NAMES, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ValueError(
        f"{value[:60]!r} is neither a chat template name hone knows nor a Jinja template (no '{{{{' or '{{%')"
        f"{hint}; names: {', '.join(CHAT_TEMPLATE_NAMES)}; or leave it unset to use the tokenizer's own template"
    )


class DataConfig(Section):
    """Datasets, formats, sequence length, evaluation split and the tokenized-data cache."""

    datasets: list[DatasetConfig] = Field(min_length=1)
    """Training datasets; several are mixed (see each one's ``weight``)."""

    test_datasets: list[DatasetConfig] = Field(default_factory=list)
    """Separate evaluation datasets. Mutually exclusive with ``val_set_size``."""

    val_set_size: float = Field(0.0, ge=0.0, lt=1.0)
    """Fraction of the training rows held out for evaluation (deterministic by seed)."""

    sequence_len: int = Field(2048, ge=8)
    """Maximum tokens per sample."""

    allow_longer_than_model: bool = False
    """Accept a ``sequence_len`` longer than the model's ``max_position_embeddings``. Off by
    default: positions past the model's trained range are extrapolated (quality may drop),
    so such a config is refused unless the model config sets a RoPE scaling (``rope_scaling``
    / ``rope_parameters`` other than default) or this is true, which trains anyway with a
    warning. See docs/errors.md."""

    excess_length_strategy: Literal["drop", "truncate"] = "drop"
    """What happens to rows longer than ``sequence_len``: dropped, or cut to fit. For a
    ``preference`` pair (prompt + the longer completion): dropped, or both completions cut to
    fit after the prompt; a pair whose prompt alone leaves no room is dropped, or refused under
    ``truncate`` (the prompt is never cut)."""

    on_bad_row: Literal["error", "skip"] = "error"
    """A row with a missing or malformed field stops preprocessing, or is skipped and counted."""

    chat_template: str | None = None
    """Chat template for ``chat`` datasets: a name (``chatml``, ``llama3``, ``qwen2``, ``qwen2.5``,
    ``qwen3``, ``mistral``, ``gemma``; see docs/datasets.md) or Jinja text; by default the
    tokenizer's own."""

    num_proc: int | None = Field(None, ge=1)
    """Worker processes for tokenization (``datasets.map``); default: one."""

    sample_packing: bool = False
    """Pack several documents into each row of ``sequence_len`` tokens (best-fit decreasing),
    with position ids restarting at 0 for every document and attention kept inside each one.
    Steps and the LR schedule follow the packed row count. Wherever the plan records CUDA
    graphs (``performance.cuda_graphs: auto`` on a host-bound step, or ``true``) every
    micro-batch's document boundaries take one count (docs/compile.md). See docs/packing.md."""

    pad_to_sequence_len: bool = False
    """Pad every unpacked micro-batch to ``sequence_len`` tokens, not to its longest row: one
    shape every step, which CUDA graphs need (``performance.cuda_graphs: auto`` then turns them
    on where the step is host-bound: MoE experts on hone's kernels, LoRA on a float8 base), at
    the cost of computing the padding. Packed rows are ``sequence_len`` wide already. Not for
    preference objectives (their pairs are packed into one row per micro-batch; ``cuda_graphs:
    true`` gives those one layout)."""

    eval_sample_packing: bool | None = None
    """Pack the eval split too; default: the same as ``sample_packing``."""

    sample_packing_group_size: int = Field(100_000, ge=1)
    """Documents packed together: the shuffled training rows are cut into groups of this many,
    each packed on its own (larger packs tighter, smaller mixes epochs' bins better)."""

    dataset_prepared_path: Path | None = None
    """Cache directory for tokenized data; default ``$HONE_CACHE_DIR/datasets`` or ``~/.cache/hone/datasets``."""

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, value: str | None) -> str | None:
        return check_chat_template(value)

    @property
    def fixed_width(self) -> int | None:
        """The width every unpacked micro-batch is padded to (``pad_to_sequence_len``); None: its longest row's."""
        return self.sequence_len if self.pad_to_sequence_len else None

    @model_validator(mode="after")
    def _one_eval_source(self) -> "DataConfig":
        if self.test_datasets and self.val_set_size > 0:
            raise ValueError(
                "set either data.val_set_size (hold out part of the training data) or "
                "data.test_datasets (separate files), not both"
            )
        return self

    @model_validator(mode="after")
    def _one_kind_of_data(self) -> "DataConfig":
        """A run trains one objective: preference pairs and SFT rows cannot share it."""
        entries = [("datasets", i, e) for i, e in enumerate(self.datasets)]
        entries += [("test_datasets", i, e) for i, e in enumerate(self.test_datasets)]
        pairs = [f"data.{s}.{i}" for s, i, e in entries if e.type == "preference"]
        others = [f"data.{s}.{i} ({e.type})" for s, i, e in entries if e.type != "preference"]
        if pairs and others:
            raise ValueError(
                f"{pairs[0]}.type: preference cannot be mixed with SFT datasets ({', '.join(others)}): "
                "a run trains either a preference objective on pairs or the language-modelling loss on rows; "
                "use one kind of dataset in data.datasets and data.test_datasets"
            )
        return self

    @property
    def is_preference(self) -> bool:
        """Whether the run's data are preference pairs (every entry then is; see ``_one_kind_of_data``)."""
        return self.datasets[0].type == "preference"

    @property
    def has_eval(self) -> bool:
        return bool(self.test_datasets) or self.val_set_size > 0

    @property
    def packs_eval(self) -> bool:
        """Whether the eval split is packed (``eval_sample_packing``, else ``sample_packing``)."""
        return self.sample_packing if self.eval_sample_packing is None else self.eval_sample_packing
