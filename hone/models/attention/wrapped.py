"""The names of attention backends that wrap another backend, and which one each wraps.

Context parallelism (:mod:`hone.models.attention.ulysses`) switches a model to a backend that
exchanges q, k, v between ranks and then calls the model's own kernel. What a packed batch must
carry (:mod:`hone.models.attention.layout`) is decided by the kernel inside, so the layout reads
the name through :func:`inner_implementation`. A fixed table, not a derived name: transformers
reads meaning into substrings of a backend's name (``flash`` loads a flash kernel by that name).
"""

from hone.models.attention.causal import CAUSAL_SDPA
from hone.models.attention.varlen import VARLEN_SDPA

#: The backends context parallelism can wrap -> the name of the wrapping backend.
ULYSSES_NAMES: dict[str, str] = {
    "sdpa": "hone_ulysses_sdpa",
    CAUSAL_SDPA: "hone_ulysses_sdpa_causal",
    VARLEN_SDPA: "hone_ulysses_sdpa_varlen",
}
_INNER = {wrapper: inner for inner, wrapper in ULYSSES_NAMES.items()}


def inner_implementation(name: str | None) -> str | None:
    """The backend that does the attention under ``name``: the wrapped one for a wrapping
    backend, ``name`` itself otherwise."""
    return _INNER.get(name, name) if name is not None else None


def is_ulysses(name: str | None) -> bool:
    """Whether ``name`` is one of context parallelism's wrapping backends."""
    return name in _INNER
