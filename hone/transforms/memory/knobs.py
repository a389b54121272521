"""What an estimate is asked about beside the config: the checkpointing policy, the loss, and the
step's shape and memory switches as the caller wants them estimated (one object, so a variant is
``dataclasses.replace(knobs, tiled_mlp="auto")`` rather than eleven keyword arguments passed on)."""

from dataclasses import KW_ONLY, dataclass
from typing import Literal

LossKind = Literal["standard", "fused_linear_ce"]


@dataclass(frozen=True)
class Knobs:
    """One step to estimate. ``None`` means "as the config says"."""

    checkpointing: str
    """``none``/``full``/``selective``/``offload``."""
    loss: LossKind
    _: KW_ONLY
    sequence_len: int | None = None
    """Default: ``data.sequence_len``."""
    context_parallel: int | None = None
    """Ranks each sequence is split over: the estimate is one rank's, ``ceil(sequence_len / N)``
    tokens outside attention (default ``distributed.context_parallel``)."""
    micro_batch: int | None = None
    """Default: ``training.micro_batch_size``."""
    compiled: bool | None = None
    """Default: whether the config compiles on ``device`` (``torch_compile: auto`` compiles on CUDA)."""
    device: str = "cuda"
    tiled_mlp: int | Literal["auto"] = 0
    """The MLP in that many shards (0: untiled; ``auto``: :func:`.terms.tiled_mlp.auto_tiled_shards` of the tokens)."""
    offload_layers: int | Literal["auto"] | None = None
    """``offload``: the host/GPU split (default ``memory.offload_layers``; ``auto``: decided on ``host_budget``)."""
    host_budget: int | None = None
    """Bytes of host memory an ``auto`` offload split is decided on (None: unlimited)."""
    param_shards: int = 1
    """Processes FSDP shards the weights, gradients and optimizer state over."""
    selective_budget: float | None = None
    """``selective`` under Inductor: the compiler's activation memory budget to estimate at
    (default ``memory.selective_memory_budget``; its ``auto`` is estimated at the floor,
    :func:`hone.config.memory.selective_budget_floor`, the least memory it may choose)."""
    tiled_layers: int | Literal["auto"] = 0
    """``full``/``offload``: each layer in that many chunks of the sequence (``auto``:
    :func:`.terms.tiled_layers.auto_layer_chunks`; 0: whole)."""
    run_layers: int = 1
    """``full``/``offload``: one saved input per run of this many layers (1: one per layer;
    :mod:`hone.transforms.layer_runs`)."""
