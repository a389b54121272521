"""Load the tokenizer a run uses: from a local directory only, never from a hub.

Where it comes from: ``model.tokenizer_path`` if set, else ``model.path``, else (for
``model.preset`` runs) the tiny byte-level BPE bundled in ``hone/assets/tokenizer`` (built by
``scripts/build_tokenizer.py``; ChatML chat template, bos ``<|begin_of_text|>``, eos
``<|im_end|>``, pad ``<|pad|>``).

Padding: batches need a pad id. If the tokenizer has no pad token, its eos token is used as
pad. That is safe in hone because padded positions are excluded by ``labels == -100`` and the
attention mask, never by comparing ids with the pad id; it is done here, once, so every
consumer sees the same ``pad_token_id``. A tokenizer with neither is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hone.config.model import ModelConfig
from hone.errors import HoneError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TokenizerError(HoneError):
    """The tokenizer directory is missing, unreadable, or unusable for training."""


def bundled_tokenizer_path() -> Path:
    """The tokenizer shipped with hone (used by presets and tests)."""
    return Path(__file__).resolve().parent.parent / "assets" / "tokenizer"


def tokenizer_source(model_cfg: ModelConfig) -> tuple[Path, str]:
    """The directory to load and the config key (or origin) that chose it, for messages.
    A hub id gives its cached snapshot (:class:`~hone.models.hub.HubModelNotFound` if absent)."""
    from hone.models.hub import local_model_dir

    if model_cfg.tokenizer_path is not None:
        return local_model_dir(model_cfg.tokenizer_path, "model.tokenizer_path"), "model.tokenizer_path"
    if model_cfg.path is not None:
        return local_model_dir(model_cfg.path, "model.path"), "model.path"
    return bundled_tokenizer_path(), "hone's bundled tokenizer"


#: Files of which a tokenizer directory needs at least one (fast, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model")


def tokenizer_dir_problems(model_cfg: ModelConfig) -> list[str]:
    """Every problem ``hone validate`` can see in the tokenizer directory without loading it:
    missing directory, no vocabulary file, a ``tokenizer_config.json`` that is not JSON."""
    import json

    from hone.models.hub import HubModelNotFound

    try:
        path, origin = tokenizer_source(model_cfg)
    except HubModelNotFound as exc:
        return [str(exc).partition(": ")[2]]
    if not path.exists():
        return [f"tokenizer directory not found: '{path}' ({origin}; relative paths are from {Path.cwd()})"]
    if not path.is_dir():
        return [f"'{path}' ({origin}) is a file; the tokenizer must be a directory written by save_pretrained"]
    problems = []
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        hint = "" if model_cfg.tokenizer_path is not None else ", or set model.tokenizer_path to a directory that has them"
        problems.append(
            f"'{path}' ({origin}) holds no tokenizer files (one of {', '.join(TOKENIZER_FILES[:3])}, ...): "
            f"copy them from the original model{hint}"
        )
    config = path / "tokenizer_config.json"
    if config.is_file():
        try:
            if not isinstance(json.loads(config.read_text(encoding="utf-8")), dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            problems.append(f"cannot read '{config}' ({origin}): {exc}")
    return problems


def load_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer for ``model_cfg``; raises :class:`TokenizerError` naming the directory."""
    from hone.models.hub import HubModelNotFound

    try:
        path, origin = tokenizer_source(model_cfg)
    except HubModelNotFound as exc:
        raise TokenizerError(str(exc)) from None
    if not path.is_dir():
        raise TokenizerError(f"tokenizer directory not found: '{path}' ({origin}; relative paths are from {Path.cwd()})")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path),
            local_files_only=True,
            trust_remote_code=model_cfg.trust_remote_code,
        )
    except Exception as exc:  # transformers raises OSError, ValueError, tokenizers' Exception...
        hint = ""
        if "trust_remote_code" in str(exc) and not model_cfg.trust_remote_code:
            hint = " (it ships its own code: set model.trust_remote_code: true only if you trust it)"
        raise TokenizerError(f"cannot load a tokenizer from '{path}' ({origin}): {type(exc).__name__}: {exc}{hint}") from exc
    if isinstance(tokenizer, bool) or not hasattr(tokenizer, "encode"):
        raise TokenizerError(f"'{path}' ({origin}) does not hold a tokenizer")
    _ensure_pad(tokenizer, path, origin)
    return tokenizer


def _ensure_pad(tokenizer: PreTrainedTokenizerBase, path: Path, origin: str) -> None:
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.eos_token is None:
        raise TokenizerError(
            f"the tokenizer in '{path}' ({origin}) has neither a pad nor an eos token; add a pad_token to its "
            "tokenizer_config.json"
        )
    tokenizer.pad_token = tokenizer.eos_token
