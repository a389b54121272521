"""``performance.cuda_graphs``: whether each compiled layer's kernels replay as one CUDA graph.

A CUDA graph replaces a layer's hundreds of kernel launches by one, which pays where the host's
launches take longer than the GPU's work (the step is host-bound) and costs nothing elsewhere
but a recording per shape and the memory the recording keeps. The rule of ``auto``, in words
(``hone plan`` prints the outcome and the first reason it is off; shapes that vary are the last
reason checked, so that it is given where graphs would pay, with what gives one shape):

- only where it is safe: compiled by Inductor on CUDA, regionally (each decoder layer: the
  measured setting), every training micro-batch of one shape (a new shape records a new graph:
  unpacked rows of different lengths stay without graphs unless ``data.pad_to_sequence_len``;
  packed rows take one shape, their boundaries padded to one count wherever the plan records
  graphs, :class:`hone.train.batches.PackedBatches`), one process or expert parallelism over
  every process beside DDP (see below), and no checkpointing that re-runs a layer's forward in
  the backward (``full``, ``offload``, tiled layers) or moves its activations (offload);
- only where it pays: MoE experts on hone's kernels, whose step is host-bound (the qwen3-30b-a3b
  slice on an H100: 64 ms a step compiled, 36 ms with CUDA graphs), and LoRA on a float8 base,
  whose quantization passes and float8 matmuls add launches that outrun the shorter GPU work
  (qwen3-8b LoRA q,k,v,o at seq 2048, every frozen linear in float8, on an H200: 146.9 ms a step
  compiled, 94.5 ms with CUDA graphs). A dense bf16 step of a large model is bound by the GPU
  (qwen3-8b at seq 2048: 126.0 ms, 125.6 with graphs), and so is a float8 full fine-tune
  (llama3.2-3b at seq 4096: 274.5 and 273.2 ms): graphs gain nothing there. Packed rows of
  a realistic length mix gain alike (H200: the MoE slice 62.2 -> 33.5 ms, LoRA on a float8
  qwen3-8b 185.7 -> 105.4 ms; benchmarks/2026-11-29-h200-packed-graphs.md).

Preference pairs replay too where ``cuda_graphs: true`` asks (``auto`` leaves them off until
measured): every pair micro-batch then takes one layout, rows as wide as the data's longest pairs
(:class:`hone.data.pairs.FixedPairRows`). A pass without grad (the reference's, eval) is one
generation of the graphs (:func:`hone.runtime.step.begin_pass`).

MXFP4 experts (a shipped checkpoint or ``model.quantize: mxfp4``) replay like bf16 ones (their
kernels have no host sync; gpt-oss-20b and qwen3-30b-a3b were measured with graphs:
benchmarks/2026-11-27-h100-mxfp4.md). Not measured yet, so not chosen by ``auto``: data-parallel
steps and an NF4 base; ``cuda_graphs: true`` turns them on where the user has measured them.

Expert parallelism beside DDP is measured and turns them on: its all-to-all exchanges sit inside
each compiled layer's graph, so the graphs record and replay NCCL all-to-alls (every rank records
the same layers in the same order; DDP's gradient all-reduce runs outside them, in eager hooks).
Without graphs the exchange makes the host-bound step worse: qwen3-30b-a3b (48 layers, expert
LoRA, seq 4096) on 2 H100 took 620.6 ms a step, 309.6 ms with graphs; on 4, 517.4 and 371.0 ms
(benchmarks/2026-11-27-h100-expert-parallel.md). Beside FSDP2 graphs cannot replay: FSDP2
gathers each layer's parameters into memory it allocates anew every step and frees after use, so
the inputs a graph recorded move and Inductor records it again, every step (2 H200s: 2,786 ms a
step with graphs asked for, 771 ms without, 380 ms beside DDP with them;
benchmarks/2026-11-29-h200x2-expert-parallel.md). ``auto`` leaves them off there and the plan
refuses ``cuda_graphs: true`` beside FSDP2 (:func:`fsdp_problem`); with LoRA, DDP is the strategy
that replays. A run that records NCCL kernels must drop its graphs before leaving the process
group (:func:`hone.train.distributed.release_cuda_graphs`).
"""

from hone.config.memory import INPUT_ONLY_POLICIES
from hone.config.root import HoneConfig
from hone.transforms.base import RunFacts
from hone.transforms.fp8_sizes import float8_lora_base

#: The measurement ``auto`` rests on (benchmarks/2026-11-26-h100-moe-lora-model.md).
_MEASURED = "qwen3-30b-a3b 8 layers with expert LoRA on an H100: 64 -> 36 ms a step"
#: Expert parallelism's (benchmarks/2026-11-27-h100-expert-parallel.md).
_MEASURED_EP = "qwen3-30b-a3b with expert LoRA on 2 H100: 620.6 -> 309.6 ms a step"
#: Expert parallelism beside FSDP2, with graphs asked for and without, against DDP with them
#: (benchmarks/2026-11-29-h200x2-expert-parallel.md, sessions 30-31).
_MEASURED_EP_FSDP = (
    "qwen3-30b-a3b with expert LoRA on 2 H200: beside FSDP2 2,786 ms a step with graphs asked for, "
    "771 ms without; beside DDP 380 ms with them"
)
#: Why graphs cannot replay beside FSDP2.
_FSDP_MOVES_INPUTS = (
    "FSDP2 gathers each layer's parameters into memory it allocates anew every step, so the inputs a graph "
    "recorded move and Inductor records it again every step"
)
#: LoRA on a float8 base, and a float8 full fine-tune (benchmarks/2026-11-29-h200-fp8.md).
_MEASURED_FP8_LORA = "qwen3-8b LoRA q,k,v,o on a float8 base, seq 2048, on an H200: 146.9 -> 94.5 ms a step"
_MEASURED_FP8_FULL = "llama3.2-3b at seq 4096 on an H200: 274.5 ms a step, 273.2 with graphs"


def _explicit_why(cfg: HoneConfig, on: bool) -> str:
    perf = cfg.performance
    if "triton.cudagraphs" in perf.torch_compile_options:
        return f"performance.torch_compile_options.triton.cudagraphs: {str(on).lower()}"
    if perf.torch_compile_mode not in (None, "default"):
        return f"performance.torch_compile_mode: {perf.torch_compile_mode}"
    return f"performance.cuda_graphs: {str(on).lower()}"


def _blocker(
    cfg: HoneConfig,
    facts: RunFacts,
    *,
    compiles: bool,
    experts: str,
    strategy: str,
    policy: str,
    tiled: bool,
    expert_parallel: int = 1,
) -> str | None:
    """The first reason ``auto`` leaves CUDA graphs off on this run (None: it turns them on)."""
    perf = cfg.performance
    if not compiles:
        return "the model is not compiled (CUDA graphs record Inductor's compiled layers)"
    if perf.torch_compile_backend != "inductor":
        return f"torch_compile_backend is {perf.torch_compile_backend}, not inductor"
    if facts.device.type != "cuda":
        return f"CUDA graphs need a CUDA device (this run: {facts.device.type})"
    if perf.torch_compile_scope != "regional":
        return "torch_compile_scope: model (measured with regional compile only)"
    if strategy == "fsdp":
        advice = ": with LoRA, prefer distributed.strategy: ddp" if expert_parallel > 1 else ""
        return f"{_FSDP_MOVES_INPUTS} ({_MEASURED_EP_FSDP}){advice}"
    if 1 < expert_parallel < facts.world.world_size:
        return (
            f"expert parallel groups of {expert_parallel} in {facts.world.world_size} processes are not measured "
            "with CUDA graphs yet (measured with one group of every process)"
        )
    if strategy != "none" and expert_parallel <= 1:
        return f"data parallelism ({strategy}) is not measured with CUDA graphs yet"
    if policy in INPUT_ONLY_POLICIES or tiled:
        return f"checkpointing {policy}{' with tiled layers/MLP' if tiled else ''} re-runs each layer's forward in the backward"
    if cfg.model.quantize == "nf4":
        return "an NF4 base is not measured with CUDA graphs yet"
    if perf.fp8 != "off" and not float8_lora_base(cfg):
        return f"a float8 full fine-tune is bound by the GPU, not by the host's launches ({_MEASURED_FP8_FULL})"
    if experts != "hone" and not float8_lora_base(cfg):
        return (
            "the step is bound by the GPU, not by the host's launches "
            "(MoE experts on hone's kernels and LoRA on a float8 base are)"
        )
    if facts.shape_note is not None:  # last: where graphs would pay, the reason to act on
        return f"{facts.shape_note} (every new shape would record another graph)"
    return None


def _why_on(cfg: HoneConfig, experts: str, expert_parallel: int) -> str:
    """What makes the step host-bound without graphs, with the measurement."""
    if expert_parallel > 1:
        return f"expert parallelism's exchanges make the step host-bound without them ({_MEASURED_EP})"
    if experts == "hone":
        return f"MoE experts on hone's kernels are host-bound without them ({_MEASURED})"
    return f"a float8 base's quantization passes make the step host-bound without them ({_MEASURED_FP8_LORA})"


def cuda_graphs_choice(
    cfg: HoneConfig,
    facts: RunFacts,
    *,
    compiles: bool,
    experts: str,
    strategy: str,
    policy: str,
    tiled: bool,
    expert_parallel: int = 1,
) -> tuple[bool, str]:
    """(on, why) of CUDA graphs for this run: as the config sets them (``cuda_graphs``,
    ``triton.cudagraphs`` or the compile mode), else by the rule of the module doc from the
    plan's other decisions (``compiles``, the ``experts`` implementation, the data-parallel
    ``strategy``, the checkpointing ``policy``, whether anything is ``tiled`` and the
    ``expert_parallel`` size)."""
    explicit = cfg.performance.cudagraphs_setting
    if explicit is not None:
        return explicit and compiles, _explicit_why(cfg, explicit)
    blocker = _blocker(
        cfg,
        facts,
        compiles=compiles,
        experts=experts,
        strategy=strategy,
        policy=policy,
        tiled=tiled,
        expert_parallel=expert_parallel,
    )
    if blocker is not None:
        return False, f"cuda_graphs: auto: off, {blocker}"
    why = f"cuda_graphs: auto: on, {_why_on(cfg, experts, expert_parallel)}"
    if not facts.shapes_known:
        why += "; if every training micro-batch has one shape (the run checks its data: rows of different lengths turn them off)"
    return True, why


def fsdp_problem(source: str, strategy: str) -> str | None:
    """Why CUDA graphs the config asks for (``source`` names the key) cannot run beside
    ``strategy``: beside FSDP2 every step would record them again (measured with expert
    parallelism; the gathering that moves the inputs is FSDP2's own, with or without it)."""
    if strategy != "fsdp":
        return None
    return (
        f"{source} uses CUDA graphs, which cannot replay beside distributed.strategy: fsdp: {_FSDP_MOVES_INPUTS} "
        f"({_MEASURED_EP_FSDP}). Use cuda_graphs: auto (off beside FSDP2) or false, or, with LoRA, "
        "distributed.strategy: ddp, where they replay"
    )
