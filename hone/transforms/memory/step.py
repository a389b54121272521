"""The step an estimate counts: its :class:`~hone.transforms.memory.knobs.Knobs` with the config's
defaults filled in, resolved once so every term reads the same sizes and no term reads the config
for them again."""

from dataclasses import dataclass
from typing import Literal

from hone.transforms.memory.knobs import LossKind


@dataclass(frozen=True)
class Step:
    policy: str
    """The checkpointing policy: ``none``/``full``/``selective``/``offload``."""
    loss: LossKind
    device: str
    sequence_len: int
    micro_batch: int
    compiled: bool
    attention: str
    """``model.attn_implementation``."""
    input_bytes: int
    """One layer's input (``tokens x hidden``, compute dtype): what checkpointing keeps per layer."""
    chunks: int
    """Tiled layers: each layer in this many chunks of the sequence (0: whole)."""
    piece: int
    """Tokens one rebuilt layer processes at a time: a chunk of every row, or the whole micro-batch."""
    shards: int
    """Tiled MLP: shards of ``piece`` (0: untiled)."""
    offload_layers: int | Literal["auto"]
    """``offload``: the layers' inputs asked to go to the host (``auto``: as many as ``host_budget`` holds)."""
    host_budget: int | None
    param_shards: int
    selective_budget: float | None
    """``selective`` under Inductor: the compiler's activation memory budget (None: eager selective)."""
    accumulating: bool
    """Gradient accumulation: earlier micro-batches' gradients are alive through the step."""
    run_layers: int = 1
    """``full``/``offload``: layers per run of layer-run checkpointing (1: each layer keeps its input)."""
    float8: tuple[str, str] | None = None
    """A full fine-tune in torchao's float8 training: (``performance.fp8``, ``performance.fp8_small_linears``)."""
    fused_lora: bool = False
    """LoRA layers run hone's fused layer (``performance.lora_linear``), which keeps no autocast
    copy of their input (:func:`~hone.transforms.memory.layers.layer_bytes`)."""
    sequences: bool = False
    """A preference objective: the loss is per-sequence log-probs (its chunk differs)."""
    exchanged_per_token: int = 0
    """Bytes per token a layer's collectives return (context parallelism's all-to-all around
    attention). Inductor's partitioner never recomputes a collective, so a compiled layer keeps
    these whole whatever its activation memory budget."""

    @property
    def tokens(self) -> int:
        return self.sequence_len * self.micro_batch

    @property
    def tiled(self) -> bool:
        """The MLP is tiled."""
        return self.shards > 0
