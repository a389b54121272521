"""Trading compute for memory: which activations each decoder layer keeps for the backward.

No torch here: the config is validated (and ``auto`` decided) before anything is loaded.
"""

from typing import Any, Literal

from pydantic import SerializationInfo, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from hone.config.base import Section
from hone.units import gib, parse_bytes

#: A concrete activation-checkpointing policy: what each decoder layer keeps for the backward.
#: This module is the one place the vocabulary is defined; the planner, the memory estimate and
#: the checkpointing transform read it from here.
Policy = Literal["none", "selective", "full", "offload"]
CheckpointingPolicy = Literal["none", "full", "selective", "offload", "auto"]

#: The concrete policies, fastest first (and so, roughly, most memory first). ``auto`` picks the
#: first of these whose estimated peak fits the device.
POLICIES_BY_SPEED: tuple[Policy, ...] = ("none", "selective", "full", "offload")

#: The policies that keep only each layer's input and rebuild the layer in the backward: what a
#: tiled decoder layer (itself the layer's checkpoint) builds on.
INPUT_ONLY_POLICIES: tuple[Policy, ...] = ("full", "offload")


#: ``selective_memory_budget: auto`` tries budgets from 1 down in these steps, to this floor: the
#: lowest measured faster than ``full`` (qwen3-8b seq 2048 on an H100: 158.6 ms at 0.2 against
#: 183.4 ms for ``full``, benchmarks/2026-11-26-h100-seam.md); below it, ``full`` is chosen.
SELECTIVE_BUDGET_FLOOR = 0.2
SELECTIVE_BUDGET_STEP = 0.05
#: The floor under expert parallelism, where ``full`` rebuilds each MoE layer with its two
#: exchanges in the backward and costs far more than a low budget (qwen3-30b-a3b over 2 H200s:
#: 1,549 ms a step under ``full`` against 402.9 ms at 0.15, benchmarks/2026-11-29-h200x2-expert-parallel.md).
SELECTIVE_BUDGET_FLOOR_EXPERT_PARALLEL = 0.15


def selective_budget_floor(expert_parallel: int | str) -> float:
    """The lowest budget ``selective_memory_budget: auto`` goes to before ``auto`` checkpointing
    takes ``full``: lower under expert parallelism (``expert_parallel`` as decided; ``auto`` not
    yet decided counts as off)."""
    split = isinstance(expert_parallel, int) and expert_parallel > 1
    return SELECTIVE_BUDGET_FLOOR_EXPERT_PARALLEL if split else SELECTIVE_BUDGET_FLOOR


def _tiling(value: Any, unit: str, whole: str) -> Any:
    """A ``tiled_*`` value: ``auto``, ``off`` or a count of pieces (2 or more). ``off`` arrives as
    false from YAML (1.1 reads a bare off as a boolean); a digit string from a command-line
    override is a count. Anything else is refused in words naming what is allowed."""
    allowed = f"allowed: auto, off, or a number of {unit}s (an integer, 2 or more)"
    if value is False:
        return "off"
    if value is True:
        raise ValueError(f"true is ambiguous here; {allowed}")
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, str):
        if value in ("auto", "off"):
            return value
        raise ValueError(f"{value!r} is not a tiling; {allowed}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise ValueError(f"{value!r} is not a tiling; {allowed}")
    if value < 2:
        raise ValueError(f"{value} is not a {unit} count that tiles (1 {unit} is {whole}); {allowed}")
    return value


class MemoryConfig(Section):
    """Activation checkpointing and tiled MLP: what each decoder layer keeps for the backward (docs/memory.md)."""

    activation_checkpointing: CheckpointingPolicy = "auto"
    """What each decoder layer keeps for the backward pass. ``none``: every activation (fastest,
    most memory). ``selective``: the outputs of matmuls and attention, recomputing the cheap ops
    (norms, activations, RoPE). ``full``: only the layer's input, recomputing the whole layer.
    ``offload``: ``full``, with the layer inputs held in pinned host memory and copied back ahead
    of the backward (least device memory). ``auto`` (the default): the fastest of these whose
    estimated peak fits the device with a margin; with a quantized base (``model.quantize``),
    which asks for little memory, never ``none`` (``selective`` then keeps the least it may).
    ``none`` where the estimate cannot read the model. ``hone plan`` prints the choice
    and why."""

    selective_memory_budget: Literal["auto"] | float = "auto"
    """``selective`` on layers compiled by Inductor: the fraction of a layer's activations the
    compiler may keep for the backward (torch's activation memory budget); it recomputes the
    cheapest ops first to stay under it. 1 keeps what runs fastest, lower saves more memory.
    ``auto``: the largest budget (in steps of 0.05, at least 0.2; 0.15 under expert parallelism,
    where ``full`` repeats the exchanges) whose estimated peak fits the device with a margin; the
    least with a quantized base (``model.quantize``: little memory).
    Without Inductor, ``selective`` keeps matmul and attention outputs and this is unused."""

    tiled_mlp: Literal["auto", "off"] | int = "auto"
    """Compute each decoder layer's MLP (dense or MoE block) in this many shards of tokens, under
    recomputation, so its ``[tokens x intermediate]`` activations never exist whole: the long
    context switch. Costs one extra MLP forward per layer in the backward. ``off``: never.
    An integer (2 or more): always, in that many shards. ``auto``: only when the memory estimate
    says the run does not fit the device untiled and does fit tiled, in about ``hidden_size``
    tokens per shard (``hone plan`` prints the choice and why)."""

    tiled_layers: Literal["auto", "off"] | int = "auto"
    """Compute each whole decoder layer in this many chunks of the sequence, in the forward and in
    the backward's recompute, so the one layer rebuilt in the backward holds one chunk's
    activations (plus the full-length keys and values) instead of the whole sequence's: what does
    not fit at 512K tokens once every layer's input is offloaded. Exact (only rounding differs);
    costs a second pass over each chunk's key projections in the backward and smaller matmuls.
    Needs ``activation_checkpointing: full`` or ``offload`` (the tiled layer is the layer's
    checkpoint), ``model.attn_implementation: sdpa``, unpacked rows and no FSDP. ``off``: never.
    An integer (2 or more): always, in that many chunks. ``auto``: only when the memory estimate
    says the run does not fit with whole layers and does fit chunked, in chunks of about 32K
    tokens (slower: 1.6x the step of whole layers at 256K tokens on an H100, so only where it is
    what fits; docs/long-context.md)."""

    offload_layers: Literal["auto"] | int = "auto"
    """``activation_checkpointing: offload``: how many decoder layers' saved inputs go to pinned
    host memory (the first ones, in forward order; the others stay on the GPU, where the backward
    needs them first); with ``checkpoint_run_layers`` above 1, how many runs' (one input each).
    ``auto``: every layer's when the host has the memory for them, else as
    many as fit the host's memory less a margin (at 512K tokens a qwen3-8b layer input is 4 GiB:
    36 of them do not fit a 128 GiB host). An integer: at most that many (0: none, which is
    ``full``). ``hone plan`` prints the split and the host memory it takes."""

    checkpoint_run_layers: Literal["auto"] | int = "auto"
    """Under ``activation_checkpointing: full`` or ``offload``: keep one saved input per run of this
    many consecutive decoder layers instead of one per layer, and rebuild the run's other inputs in
    the backward by running the run's first layers once more (one more forward of k-1 layers per
    run; the backward still rebuilds one layer's activations at a time). Exact (only rounding
    differs). For when the layers' saved inputs are what does not fit, on the GPU or, under
    ``offload``, in host memory: at 512K tokens a qwen3-8b layer input is 4 GiB, and the 36 of them
    fit neither an 80 GiB card nor a 128 GiB host; runs of two need 18 (72 GiB, on the host).
    ``memory.offload_layers`` then counts runs. ``1``: one input per layer (plain checkpointing).
    An integer (2 or more): runs of that many layers (the last run shorter where it does not
    divide the layers). ``auto``: 1 wherever that fits; where it does not, the shortest runs that
    make the run fit (``hone plan`` prints the choice and why)."""

    expandable_segments: Literal["auto"] | bool = "auto"
    """CUDA only: let torch's caching allocator grow one virtual segment instead of reserving
    separate ones (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), so freed memory is
    reusable whatever the size of the next tensor. At long context, GiB-sized activations of
    changing sizes otherwise fragment the reserved memory (qwen3-8b at 256K ran out with 31 GiB
    reserved but unusable). ``auto``: on from 32,768 tokens a micro-batch. A setting already in
    the environment (``PYTORCH_CUDA_ALLOC_CONF``) is left as it is."""

    gpu_memory: str = "auto"
    """CUDA only: the memory of each GPU the run plans for and may use. ``auto`` (the default):
    the card's own. A size (``80GiB``, ``24GB``, ``81559MiB``; a bare number is GiB) makes every
    ``auto`` decision plan for a card of that size and caps this process's allocations there
    (``torch.cuda.set_per_process_memory_fraction``: past it an allocation fails as on the
    smaller card): to run as on an 80 GiB H100 on a 141 GiB H200, or to leave room for another
    process. At most the card's memory. ``hone plan`` plans for it unless ``--gpu-memory`` says
    otherwise."""

    gradient_checkpointing: bool | None = None
    """Old name, kept as an alias: ``true`` is ``activation_checkpointing: full``, ``false`` is
    ``none``. Set one of the two keys, not both with different meanings."""

    @field_validator("gpu_memory", mode="before")
    @classmethod
    def _gpu_memory_is_a_size(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)  # YAML's `gpu_memory: 80`: GiB
        if isinstance(value, str) and value != "auto":
            parse_bytes(value)  # the error names the value and what is allowed; the loader adds the key
        return value

    @property
    def gpu_memory_bytes(self) -> int | None:
        """``gpu_memory`` in bytes; None for ``auto`` (the card's own)."""
        return None if self.gpu_memory == "auto" else parse_bytes(self.gpu_memory, "memory.gpu_memory")

    @field_validator("selective_memory_budget")
    @classmethod
    def _budget_is_a_fraction(cls, value: Any) -> Any:
        if value != "auto" and not 0 < value <= 1:
            raise ValueError(f"{value} is not a fraction of the activations; allowed: a number in (0, 1], or auto")
        return value

    @field_validator("tiled_mlp", mode="before")
    @classmethod
    def _tiled_mlp_value(cls, value: Any) -> Any:
        return _tiling(value, "shard", "the untiled MLP")

    @field_validator("tiled_layers", mode="before")
    @classmethod
    def _tiled_layers_value(cls, value: Any) -> Any:
        return _tiling(value, "chunk", "the untiled layer")

    @field_validator("offload_layers", mode="before")
    @classmethod
    def _offload_layers_value(cls, value: Any) -> Any:
        """``auto`` or a count of layers (0 or more); a digit string from a command-line override
        is a count."""
        allowed = "allowed: auto, or a number of layers (an integer, 0 or more)"
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value.strip())
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{value!r} is not a number of layers; {allowed}")
        if value < 0:
            raise ValueError(f"{value} is negative; {allowed}")
        return value

    @field_validator("checkpoint_run_layers", mode="before")
    @classmethod
    def _run_layers_value(cls, value: Any) -> Any:
        """``auto`` or a count of layers per run (1 or more); a digit string from a command-line
        override is a count."""
        allowed = "allowed: auto, or a number of layers per run (an integer, 1 or more; 1 is one input per layer)"
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value.strip())
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{value!r} is not a number of layers per run; {allowed}")
        if value < 1:
            raise ValueError(f"{value} layers per run is not a run; {allowed}")
        return value

    @property
    def run_layers(self) -> int | None:
        """The configured layers per run; None for ``auto`` (the planner decides)."""
        return None if self.checkpoint_run_layers == "auto" else int(self.checkpoint_run_layers)

    @model_validator(mode="after")
    def _runs_keep_inputs_only(self) -> "MemoryConfig":
        """A run rebuilds its inner inputs from its first one: every layer must keep only its input."""
        runs = self.run_layers
        if runs is not None and runs > 1 and self.checkpointing not in (*INPUT_ONLY_POLICIES, "auto"):
            raise ValueError(
                f"memory.checkpoint_run_layers: {runs} needs memory.activation_checkpointing: full or offload (a run "
                f"keeps its first layer's input only, and each layer must keep only its input), got "
                f"{self.checkpointing}; allowed: full, offload, or checkpoint_run_layers: 1"
            )
        return self

    @property
    def tiled_mlp_shards(self) -> int | None:
        """The configured shard count; None for ``auto`` (the planner decides), 0 for ``off``."""
        if self.tiled_mlp == "auto":
            return None
        return 0 if self.tiled_mlp == "off" else int(self.tiled_mlp)

    @property
    def tiled_layers_chunks(self) -> int | None:
        """The configured chunk count; None for ``auto`` (the planner decides), 0 for ``off``."""
        if self.tiled_layers == "auto":
            return None
        return 0 if self.tiled_layers == "off" else int(self.tiled_layers)

    @model_validator(mode="after")
    def _tiled_layers_are_a_checkpoint(self) -> "MemoryConfig":
        """A tiled layer is the layer's checkpoint (it keeps only its input): without
        checkpointing, or with selective checkpointing, the other layers would keep everything."""
        if self.tiled_layers_chunks and self.checkpointing not in (*INPUT_ONLY_POLICIES, "auto"):
            raise ValueError(
                f"memory.tiled_layers: {self.tiled_layers} needs memory.activation_checkpointing: full or offload "
                f"(a tiled layer is the layer's checkpoint), got {self.checkpointing}; allowed: full, offload, "
                "or tiled_layers: off"
            )
        return self

    @model_validator(mode="after")
    def _alias_agrees(self) -> "MemoryConfig":
        if self.gradient_checkpointing is None or not self.explicitly_set("activation_checkpointing"):
            return self
        implied = _ALIAS[self.gradient_checkpointing]
        if self.activation_checkpointing != implied:
            word = "true" if self.gradient_checkpointing else "false"
            raise ValueError(
                f"memory.gradient_checkpointing: {word} (an alias of memory.activation_checkpointing: "
                f"{implied}) disagrees with memory.activation_checkpointing: {self.activation_checkpointing}; "
                "set only memory.activation_checkpointing"
            )
        return self

    @model_serializer(mode="wrap")
    def _write_the_policy(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        """The resolved config writes the policy under its own key and drops the alias, so it
        loads back meaning the same thing (writing both would read as a disagreement)."""
        data = handler(self)
        data["activation_checkpointing"] = self.checkpointing
        data.pop("gradient_checkpointing", None)
        return data

    @property
    def checkpointing(self) -> str:
        """The policy in force, the alias resolved (``auto`` stays ``auto``: the planner decides
        it from the memory estimate with :func:`choose_auto_policy`)."""
        if self.gradient_checkpointing is not None and not self.explicitly_set("activation_checkpointing"):
            return _ALIAS[self.gradient_checkpointing]
        return self.activation_checkpointing

    @property
    def alias_note(self) -> str | None:
        """A line for the console and the run log when the config used the old key."""
        if self.gradient_checkpointing is None:
            return None
        return (
            f"memory.gradient_checkpointing is an alias of memory.activation_checkpointing: {_ALIAS[self.gradient_checkpointing]}"
        )


_ALIAS: dict[bool, str] = {True: "full", False: "none"}


def choose_auto_policy(estimates: dict[str, int], budget_bytes: int, margin: float = 0.1) -> tuple[str, str]:
    """``activation_checkpointing: auto``: the fastest policy whose estimated peak fits.

    ``estimates`` maps policies (``none``, ``selective``, ``full``, ``offload``) to estimated peak
    bytes; policies without an estimate are not considered. The usable budget is
    ``budget_bytes * (1 - margin)``: estimates are not exact and the allocator fragments.
    Returns ``(policy, reason)``. When nothing fits, the policy with the smallest estimate is
    returned with a reason that says so (the caller decides whether to refuse the run).
    """
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    known = [p for p in POLICIES_BY_SPEED if p in estimates]
    unknown = sorted(set(estimates) - set(POLICIES_BY_SPEED))
    if unknown or not known:
        raise ValueError(f"estimates must name some of {', '.join(POLICIES_BY_SPEED)}; got {sorted(estimates)}")
    usable = int(budget_bytes * (1 - margin))
    limit = f"{gib(usable)} ({gib(budget_bytes)} less a {margin:.0%} margin)"
    for i, policy in enumerate(known):
        if estimates[policy] <= usable:
            faster = [f"{p} needs {gib(estimates[p])}" for p in known[:i]]
            why = f"; {', '.join(faster)}" if faster else ""
            return policy, f"{policy}: the fastest policy that fits, estimated peak {gib(estimates[policy])} <= {limit}{why}"
    smallest = min(known, key=lambda p: estimates[p])
    every = ", ".join(f"{p} {gib(estimates[p])}" for p in known)
    return smallest, f"{smallest}: no policy fits {limit} ({every}); {smallest} needs the least"
