"""Speed: ``torch.compile`` and the Inductor options a user may tune.

Key names follow Axolotl (``torch_compile``, ``torch_compile_backend``, ``torch_compile_mode``,
``torch_compile_options``) so configs carry over. Everything here is checked without importing
torch: the allowlist below is plain data, and a test walks it on the installed torch so an
upstream rename fails CI instead of a user's run.
"""

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator, model_validator

from hone.config.base import Section

#: The ``torch._inductor.config`` keys a config may set, with the Python type each one takes.
#: Dotted keys name nested config objects (``triton.cudagraphs`` is ``config.triton.cudagraphs``).
#: Kept short on purpose: each key here is one hone documents, tests on every torch it supports
#: and can benchmark; anything else stays out of reach rather than silently doing nothing.
INDUCTOR_OPTIONS: dict[str, type] = {
    "coordinate_descent_tuning": bool,
    "coordinate_descent_check_all_directions": bool,
    "shape_padding": bool,
    "epilogue_fusion": bool,
    "max_autotune_gemm": bool,
    "fx_graph_cache": bool,
    "assume_aligned_inputs": bool,
    "comprehensive_padding": bool,
    "decompose_mem_bound_mm": bool,
    "reorder_for_compute_comm_overlap": bool,
    "triton.cudagraphs": bool,
}

#: ``torch.compile`` modes and whether each one turns on CUDA graphs (``triton.cudagraphs``),
#: as ``torch._inductor.list_mode_options`` maps them (a test checks this on the installed torch).
COMPILE_MODES: dict[str, bool] = {
    "default": False,
    "reduce-overhead": True,
    "max-autotune": True,
    "max-autotune-no-cudagraphs": False,
}

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
OptionValue = StrictBool | StrictInt | StrictFloat | StrictStr

_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_COMPILE_KEYS = ("torch_compile_scope", "torch_compile_mode", "torch_compile_backend", "torch_compile_options")
#: Keys that only mean something with ``fp8`` on.
_FP8_KEYS = ("fp8_base_linears", "fp8_small_linears", "fp8_emulate", "fp8_head")


class PerformanceConfig(Section):
    """``torch.compile``: whether, what (each decoder layer or the whole model), backend, mode and allowlisted Inductor options (docs/compile.md); the loss computation."""  # noqa: E501 - one line: the text goes verbatim into docs/config.md, and ruff format re-joins a split docstring

    torch_compile: bool | Literal["auto"] = "auto"
    """Compile the model with ``torch.compile``. ``auto`` (the default): compile when training
    on CUDA (each decoder layer, ``torch_compile_scope: regional``: a cold start of seconds),
    run eagerly elsewhere (on CPU compiling costs more than it saves on small models)."""

    torch_compile_scope: Literal["regional", "model"] = "regional"
    """``regional`` compiles each decoder layer (all layers share one compiled graph: a short
    cold start, reused by every layer); ``model`` compiles the whole model forward at once."""

    torch_compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """``inductor`` generates fused kernels; ``aot_eager``/``eager`` only trace (for finding
    whether a problem lies in tracing or in code generation)."""

    torch_compile_mode: CompileMode | None = None
    """``torch.compile`` mode; ``reduce-overhead`` and ``max-autotune`` use CUDA graphs, which
    need fixed shapes. Default: torch's ``default``."""

    torch_compile_options: dict[str, OptionValue] = Field(default_factory=dict)
    """Inductor options, applied to hone's compiled code only (not process-wide). Allowed:
    coordinate_descent_tuning, coordinate_descent_check_all_directions, shape_padding,
    epilogue_fusion, max_autotune_gemm, fx_graph_cache, assume_aligned_inputs,
    comprehensive_padding, decompose_mem_bound_mm, reorder_for_compute_comm_overlap,
    triton.cudagraphs (all true/false)."""

    cuda_graphs: bool | Literal["auto"] = "auto"
    """Replay each compiled layer's kernels as a CUDA graph (Inductor's ``triton.cudagraphs``):
    one launch instead of hundreds, for steps whose GPU work is short beside the host's launch
    time. Needs compilation with Inductor on CUDA and one fixed micro-batch shape (packed rows
    take one; unpacked rows of different lengths do not, unless ``data.pad_to_sequence_len``). ``auto``: on
    where the step is host-bound without them and they are safe: MoE experts on hone's kernels
    (no host syncs) and LoRA on a float8 base, one process or expert parallelism over every
    process beside DDP, regional compile, no checkpointing or ``selective`` (the qwen3-30b-a3b
    slice: 73 -> 37 ms on an H100; expert parallel on 2 H100: 620.6 -> 309.6 ms; qwen3-8b LoRA
    on a float8 base: 146.9 -> 94.5 ms on an H200); off elsewhere, e.g. a dense bf16 8B step or
    a float8 full fine-tune, which the GPU bounds (``hone plan`` prints the choice and why).
    Setting ``triton.cudagraphs`` in ``torch_compile_options`` or a ``torch_compile_mode`` that
    uses CUDA graphs decides it too."""

    loss: Literal["auto", "fused_linear_ce", "standard"] = "auto"
    """How the training and eval loss is computed from the last hidden states. ``fused_linear_ce``
    never materialises the [tokens x vocab] logits (chunks over tokens, gradients produced chunk
    by chunk; equal to ``standard`` within float rounding); ``standard`` computes the logits and
    upcasts them to float32 as transformers does. ``auto``: the fused loss wherever it applies
    (models whose logits are the plain output projection), the standard one elsewhere."""

    lora_linear: Literal["auto", "fused", "peft"] = "auto"
    """How a LoRA-wrapped linear layer computes ``base(x) + B(A(x)) * s`` (docs/lora.md).
    ``fused``: hone's layer, whose matmuls add the LoRA product into the base's output and input
    gradient in their epilogue and scale the rank-wide tensors, so no ``[tokens, features]`` LoRA
    output or gradient is written (the same numbers up to the dtype's rounding; llama3-8b LoRA on
    all seven projections at seq 4096 on an H200: 1.5-2.7% faster a step on a bf16 base, 4.7% on
    a float8 one, 0.5-2.4 GiB less). ``peft``: PEFT's own forward. ``auto``: ``fused``. Either way
    the adapter is PEFT's (same files, merging, adapter switching); a layer state the fused layer
    does not cover (DoRA, a LoRA bias, several active adapters, adapters off, QLoRA's 4-bit base)
    runs PEFT's forward."""

    fp8: Literal["off", "auto", "rowwise", "tensorwise"] = "off"
    """Float8 matmuls for the base's linear layers (docs/quantization.md), on GPUs of compute
    capability >= 8.9 (Ada, Hopper). With LoRA the frozen base weights are quantized once and
    the LoRA path stays bf16; a full fine-tune goes through torchao's float8 training (every
    linear but the output head). ``rowwise``: a scale per row (more accurate); ``tensorwise``:
    one per tensor (with FSDP2, weights are all-gathered in float8). ``auto``: float8, with the
    scaling measured faster for the run (tensorwise; rowwise for LoRA under context parallelism;
    ``hone plan`` says which). ``off`` (the default): bf16,
    since float8 rounds more than the model's dtype. Needs model.dtype bfloat16."""

    fp8_base_linears: Literal["auto", "lora_targets", "all"] = "auto"
    """With LoRA and ``fp8`` on: which frozen linears compute in float8. ``lora_targets``: the
    projections LoRA wraps; ``all``: every frozen linear but the output head (two float8 copies
    of each, 2 bytes a weight). ``auto``: ``all`` where CUDA graphs replay the step, else
    ``lora_targets``: without graphs the float8 step is host-bound and every converted linear
    adds launches (qwen3-8b LoRA q,k,v,o at seq 2048 on an H200: ``all`` 94.5 ms a step with
    graphs; without them ``lora_targets`` 120.6 ms, ``all`` 146.9)."""

    fp8_emulate: bool = False
    """A float8 full fine-tune on a device without float8 matmuls (the CPU, a GPU older than Ada):
    torchao's emulation does every quantization, scale and amax reduction (and FSDP2's float8
    all-gather) as on an H100 and the matmuls of the dequantized operands in high precision. For
    checking a float8 recipe's numerics (slow); a full fine-tune only (hone's float8 LoRA base has
    no emulation)."""

    fp8_small_linears: Literal["fp8", "bf16"] = "fp8"
    """With ``fp8`` on: whether linears too narrow for a float8 matmul to repay the scaling of its
    input and output gradient per call convert anyway (``fp8``) or stay in bf16 (``bf16``). Narrow
    is input width <= 4096 and output <= 1024 for tensorwise; output <= 2048, input <= 1024, or
    output <= 4096 with input <= 2048 for rowwise (torchao's H100 break-even shapes). At 3B-8B
    the two are within 1% on an H100 (docs/quantization.md); models of hidden size <= 2048, where
    most layers are narrow, are where ``bf16`` may pay off (not measured)."""

    fp8_head: bool = False
    """With LoRA and ``fp8`` on: the frozen output head's two matmuls (the logits and the hidden
    states' gradient, the largest of a step at a 128K-152K vocabulary) in float8 too, inside the
    fused loss (rowwise whatever ``fp8`` scales the base with, so the loss does not depend on its
    chunking; hone/kernels/cross_entropy_fp8.py). The logits then carry float8's rounding, which
    the loss sees directly; off by default until its speed and convergence are measured on GPUs.
    Needs the fused loss (``loss: auto`` or ``fused_linear_ce``) and SFT (not a preference
    objective); costs two float8 copies of the head (2 bytes a weight)."""

    @field_validator("torch_compile_options", mode="before")
    @classmethod
    def _allowlisted(cls, options: Any) -> Any:
        """Checked before pydantic's own parsing, so a bad value gets the key's expected type
        in the message rather than a list of union branches."""
        if not isinstance(options, dict):
            return options  # pydantic reports "expected a mapping"
        problems = []
        for key, value in options.items():
            wanted = INDUCTOR_OPTIONS.get(key)
            if wanted is None and isinstance(value, dict):
                dotted = f"{key}.{next(iter(value), 'name')}"
                problems.append(
                    f"'{key}' is not an allowed Inductor option (a nested option is one dotted key, e.g. "
                    f"'{dotted}'; on the command line: --set 'performance.torch_compile_options={{{dotted}: true}}')"
                )
            elif wanted is None:
                problems.append(f"'{key}' is not an allowed Inductor option")
            elif type(value) is not wanted:
                problems.append(f"'{key}' must be {_TYPE_WORDS[wanted]}, got {value!r} ({type(value).__name__})")
        if problems:
            raise ValueError("; ".join(problems) + f". Allowed keys: {', '.join(INDUCTOR_OPTIONS)}")
        return options

    @model_validator(mode="after")
    def _compile_keys_need_compile(self) -> "PerformanceConfig":
        if self.torch_compile is False:
            # Values that differ from their defaults: a resolved config (every key written out)
            # loads back as written.
            stray = [
                k for k in _COMPILE_KEYS if getattr(self, k) != type(self).model_fields[k].get_default(call_default_factory=True)
            ]
            if stray:
                raise ValueError(
                    f"{', '.join(stray)} only apply when compiling but performance.torch_compile is false: "
                    "set torch_compile: true (or auto), or remove them"
                )
        if self.cuda_graphs is True and self.torch_compile is False:
            raise ValueError(
                "performance.cuda_graphs: true records Inductor's compiled kernels, but performance.torch_compile is "
                "false: set torch_compile: true (or auto), or cuda_graphs: auto"
            )
        self._cuda_graphs_agree()
        if self.fp8 == "off":
            stray = [
                f"{k}: {getattr(self, k)}" for k in _FP8_KEYS if getattr(self, k) != type(self).model_fields[k].get_default()
            ]
            if stray:
                raise ValueError(
                    f"{', '.join(stray)} only applies with fp8 on but performance.fp8 is off: "
                    "set fp8: auto, rowwise or tensorwise, or remove it"
                )
        if self.torch_compile_backend != "inductor":
            inductor_only = [k for k in ("torch_compile_mode", "torch_compile_options") if getattr(self, k)]
            if self.cuda_graphs is True:
                inductor_only.append("cuda_graphs")
            if inductor_only:
                raise ValueError(
                    f"{', '.join(inductor_only)} configure Inductor but torch_compile_backend is "
                    f"'{self.torch_compile_backend}': use torch_compile_backend: inductor, or remove them"
                )
        return self

    def _cuda_graphs_agree(self) -> None:
        """``cuda_graphs`` written beside a mode or an Inductor option that says the opposite."""
        if self.cuda_graphs == "auto":
            return
        said = {}
        if "triton.cudagraphs" in self.torch_compile_options:
            said["torch_compile_options.triton.cudagraphs"] = bool(self.torch_compile_options["triton.cudagraphs"])
        if self.torch_compile_mode not in (None, "default"):
            said[f"torch_compile_mode: {self.torch_compile_mode}"] = COMPILE_MODES[self.torch_compile_mode]
        against = [key for key, value in said.items() if value != self.cuda_graphs]
        if against:
            word = "true" if self.cuda_graphs else "false"
            raise ValueError(
                f"performance.cuda_graphs: {word} disagrees with performance.{', '.join(against)}; "
                "set CUDA graphs in one place (cuda_graphs), or leave cuda_graphs: auto"
            )

    def compiles_on(self, device_type: str) -> bool:
        """Whether a run on ``device_type`` (``cuda``, ``cpu``, ...) compiles."""
        if self.torch_compile == "auto":
            return device_type == "cuda"
        return self.torch_compile

    @property
    def may_compile(self) -> bool:
        """True unless compilation is off whatever the device."""
        return self.torch_compile is not False

    @property
    def cudagraphs_setting(self) -> bool | None:
        """CUDA graphs as the config decides them (``triton.cudagraphs``, a mode that names them
        or ``cuda_graphs``); None where ``cuda_graphs: auto`` leaves them to the planner."""
        if "triton.cudagraphs" in self.torch_compile_options:
            return bool(self.torch_compile_options["triton.cudagraphs"])
        if self.torch_compile_mode not in (None, "default"):
            return COMPILE_MODES[self.torch_compile_mode]
        return None if self.cuda_graphs == "auto" else self.cuda_graphs

    @property
    def uses_cudagraphs(self) -> bool:
        """CUDA graphs asked for by the config itself (``cuda_graphs: true``, ``triton.cudagraphs``
        or the mode); what ``auto`` decides is the plan's (``Decisions.cuda_graphs``)."""
        return bool(self.cudagraphs_setting)

    @property
    def cudagraphs_source(self) -> str:
        """The key that turned CUDA graphs on, for messages."""
        if self.torch_compile_options.get("triton.cudagraphs"):
            return "performance.torch_compile_options.triton.cudagraphs"
        if COMPILE_MODES.get(self.torch_compile_mode or "default"):
            return f"performance.torch_compile_mode '{self.torch_compile_mode}'"
        return "performance.cuda_graphs: true"
