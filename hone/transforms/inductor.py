"""Inductor settings of a run: the options handed to ``torch.compile`` and the cache directory.

Options are never written into ``torch._inductor.config`` (that would change every later
compilation in the process, hone's or not). They go to ``torch.compile(options=...)``, which
Inductor applies as a scoped ``config.patch`` around the forward compilation *and* around the
backward one, which AOTAutograd compiles lazily at the first backward call. A mode is turned
into its options with ``torch._inductor.list_mode_options`` because ``torch.compile`` takes a
mode or options, not both; the user's options win over the mode's.
"""

import functools
import os
from pathlib import Path
from typing import Any

from hone.config.performance import INDUCTOR_OPTIONS, PerformanceConfig

#: The scheduler passes that make ``reorder_for_compute_comm_overlap`` do something: torch's
#: default list is empty, so the switch alone moves no collective and no wait (a compiled
#: expert-parallel layer in 2 chunks kept every wait right after its all-to-all, with the switch
#: on as off). These are the ones torch's config recommends: issue collectives as early as the
#: peak memory allows, then sink each wait to the first use of what it waits for.
COMM_OVERLAP_PASSES = (
    "reorder_communication_preserving_peak_memory",
    "sink_waits_iterative",
    "reorder_communication_preserving_peak_memory",
)

#: Environment variable Inductor reads for its on-disk caches (FX graphs, AOTAutograd results,
#: autotuning, and Triton kernels in its ``triton/`` subdirectory unless TRITON_CACHE_DIR is set).
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_options(perf: PerformanceConfig) -> dict[str, Any] | None:
    """The ``options`` argument of ``torch.compile`` for this config (None: torch's defaults)."""
    if perf.torch_compile_backend != "inductor":
        return None
    options: dict[str, Any] = {}
    if perf.torch_compile_mode not in (None, "default"):
        from torch._inductor import list_mode_options

        options.update(list_mode_options(perf.torch_compile_mode))
    options.update(perf.torch_compile_options)
    if options.get("reorder_for_compute_comm_overlap") and not read_option("reorder_for_compute_comm_overlap_passes"):
        options["reorder_for_compute_comm_overlap_passes"] = list(COMM_OVERLAP_PASSES)
    return options or None


def default_cache_dir() -> Path:
    """``$HONE_CACHE_DIR/inductor``, else ``~/.cache/hone/inductor``: per user and persistent,
    unlike torch's default under /tmp, so a second run of a config reuses the compiled kernels."""
    root = os.environ.get("HONE_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "hone") / "inductor"


def configure_cache_dir() -> tuple[Path, bool]:
    """Point Inductor's caches at :func:`default_cache_dir` unless the user chose a directory.

    Returns the directory in use and whether hone chose it. Must run before the first
    compilation in the process (Inductor's compile workers inherit the environment when they
    start). Importing ``torch._dynamo`` already writes torch's own default (under /tmp) into the
    variable, so that value counts as unset; Inductor reads the variable again at every cache
    access, so setting it afterwards takes effect.
    """
    chosen = os.environ.get(CACHE_ENV)
    if chosen and not _is_torch_default(chosen):
        return Path(chosen), False
    path = default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(path)
    return path, True


def read_option(key: str) -> Any:
    """The value of an allowlisted (possibly dotted) key in ``torch._inductor.config`` now.

    ``triton.cudagraphs`` lives on the nested ``config.triton`` object, so the key is walked
    part by part; an ``AttributeError`` means torch renamed or dropped it.
    """
    import torch._inductor.config as inductor_config

    return functools.reduce(getattr, key.split("."), inductor_config)


def installed_defaults() -> dict[str, Any]:
    """Every allowlisted key's value on the installed torch (docs/compile.md tabulates these)."""
    return {key: read_option(key) for key in INDUCTOR_OPTIONS}


def _is_torch_default(path: str) -> bool:
    """Whether ``path`` is the directory torch picks by itself when the variable is unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default

    return os.path.abspath(path) == os.path.abspath(torch_default())
