"""``torch.compile`` as a transform: each decoder layer (regional) or the whole model.

Regional compilation compiles every decoder layer *in place* (``nn.Module.compile``): the
module tree, parameter names and state-dict keys stay exactly as they were, so PEFT saving,
checkpoints and resume see no ``_orig_mod`` prefix. All layers run the same code, so Dynamo
traces one graph and every layer reuses it (its guards check the layer's structure, not its
identity): the cold start is that of one layer, whatever the depth.

Two things would make layers disagree and compile twice:

- the first layer's input. With LoRA the embedding is frozen, so layer 0 receives a tensor
  that does not require grad while every later layer's input does, and Dynamo guards on that.
  The embedding output is marked as requiring grad (transformers' public
  ``enable_input_require_grads``, the same switch activation checkpointing uses): one graph for
  all layers, at the price of the input gradient of layer 0 (well under 1% of a step).
- per-layer Python attributes read in the forward (e.g. alternating sliding-window layers of
  Gemma 3). Those legitimately give one graph per distinct value; the compile watch counts them.

Activation checkpointing composes: transformers' checkpointing layer overrides the layer's
``__call__`` and calls the compiled forward inside the checkpoint (seen on torch 2.11 with
transformers 5.17: Inductor's kernels run inside torch's checkpoint, which is why selective
checkpointing under Inductor is the compiler's memory budget instead; see the planner).
Shapes: when every micro-batch has one shape (fixed-length rows, or packing into bins of
``sequence_len``) the graphs are static, which gives Inductor the most to specialise on (with
packing, a flash backend's varying document count recompiles once into a dynamic graph). When rows of different
lengths are padded per micro-batch, the graphs are compiled with dynamic shapes from the start
(``dynamic=True``): otherwise the first new length would recompile (and the second variant of
each graph, e.g. eval's, again), and those recompiles count against Dynamo's per-function
limit, past which it silently falls back to eager.

As a transform (:data:`COMPILE`) it comes after everything that swaps modules or kernels
(compilation traces whatever modules it finds) and before data parallelism, which shards or
wraps the compiled layers.
"""

from typing import Any

from torch import nn

from hone.config.performance import PerformanceConfig
from hone.config.root import HoneConfig
from hone.errors import HoneError
from hone.models.structure import causal_lm_parts, decoder_layers, stands_in_for_layer, unwrap_peft
from hone.transforms.base import PlanContext, RunFacts, Transform
from hone.transforms.cuda_graphs import fsdp_problem
from hone.transforms.inductor import compile_options, configure_cache_dir


class CompileError(HoneError):
    """The model cannot be compiled the way the config asks."""


def compile_choice(cfg: HoneConfig, facts: RunFacts) -> tuple[bool, str]:
    """(compiles, why) of ``performance.torch_compile`` on this run: ``auto`` (the default)
    compiles when training on CUDA, regionally unless ``torch_compile_scope`` says otherwise (a
    cold start of seconds; qwen3-8b LoRA at seq 2048 on an H100: 134 ms a step against 264 ms
    eager), and runs eagerly elsewhere."""
    perf = cfg.performance
    compiles = perf.compiles_on(facts.device.type)
    if perf.torch_compile != "auto":
        return compiles, f"performance.torch_compile: {str(perf.torch_compile).lower()}"
    if compiles:
        return True, f"torch_compile: auto: on, training on CUDA ({perf.torch_compile_scope})"
    return False, f"torch_compile: auto compiles on CUDA only; this run trains on {facts.device.type}"


def compile_regional(model: nn.Module, perf: PerformanceConfig, dynamic: bool, cuda_graphs: bool = False) -> dict[str, Any]:
    """Compile each decoder layer in place; returns what was done, for optimizations.json."""
    layers = decoder_layers(model)
    if not layers:
        raise CompileError(
            f"performance.torch_compile_scope: regional found no decoder layers in {type(model).__name__} "
            "(no module of a class listed in its _no_split_modules); use torch_compile_scope: model"
        )
    base = unwrap_peft(model)
    input_grads = _embedding_output_needs_grad(base)
    kwargs = _compile_kwargs(perf, dynamic, cuda_graphs)
    for layer in layers:
        # a stand-in (tiled layer, layer run) runs its inner layer (chunk by chunk): that is what
        # compiles; stand-ins nest (a layer run around a tiled layer)
        while stands_in_for_layer(layer):
            layer = layer.inner
        layer.compile(**kwargs)
    classes = sorted({type(layer).__name__ for layer in layers})
    return {
        "scope": "regional",
        "layers": len(layers),
        "layer_classes": classes,
        "backend": perf.torch_compile_backend,
        "options": kwargs.get("options") or {},
        "dynamic_shapes": dynamic,
        "first_layer_input_requires_grad": input_grads,
    }


def compile_model(model: nn.Module, perf: PerformanceConfig, dynamic: bool, cuda_graphs: bool = False) -> dict[str, Any]:
    """Compile the whole decoder's forward in place: the loop runs the decoder and hands its
    hidden states to the loss (which the loss transform compiles, or a fused op computes)."""
    kwargs = _compile_kwargs(perf, dynamic, cuda_graphs)
    decoder, _ = causal_lm_parts(model)
    decoder.compile(**kwargs)
    return {
        "scope": "model",
        "backend": perf.torch_compile_backend,
        "options": kwargs.get("options") or {},
        "dynamic_shapes": dynamic,
    }


def _compile_kwargs(perf: PerformanceConfig, dynamic: bool, cuda_graphs: bool) -> dict[str, Any]:
    """``dynamic=False`` would recompile for every new shape, so fixed shapes get torch's
    ``None`` (static first) and varying ones ``True``. ``cuda_graphs``: the plan's decision,
    handed to Inductor as its ``triton.cudagraphs`` option where the config did not set it."""
    kwargs: dict[str, Any] = {"backend": perf.torch_compile_backend, "dynamic": True if dynamic else None}
    options = compile_options(perf)
    if cuda_graphs and not (options or {}).get("triton.cudagraphs"):
        options = {**(options or {}), "triton.cudagraphs": True}
    if options:
        kwargs["options"] = options
    return kwargs


def _embedding_output_needs_grad(base: nn.Module) -> bool:
    """Make layer 0's input require grad like every other layer's (see the module docstring).
    Returns whether it had to (False when the embedding trains, or the model has no hook)."""
    embedding = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    if embedding is None or embedding.weight.requires_grad or not hasattr(base, "enable_input_require_grads"):
        return False
    if getattr(base, "_require_grads_hook", None) is None:  # not already on (checkpointing turns it on)
        base.enable_input_require_grads()
    return True


def _check(ctx: PlanContext) -> list[str]:
    """Where CUDA graphs the config asks for cannot run (``auto`` never turns them on there)."""
    perf, facts = ctx.cfg.performance, ctx.facts
    if not (ctx.decided.cuda_graphs and perf.uses_cudagraphs):
        return []
    problems = []
    if facts.device.type != "cuda":
        problems.append(f"{perf.cudagraphs_source} uses CUDA graphs, which need a CUDA device (training on {facts.device.type})")
    if facts.shape_note is not None:
        problems.append(
            f"{perf.cudagraphs_source} uses CUDA graphs, which need one fixed shape, but {facts.shape_note}. Every "
            "new shape would record another graph and hold its memory: use triton.cudagraphs: false (or "
            "torch_compile_mode: max-autotune-no-cudagraphs), or train on rows of one length"
        )
    beside_fsdp = fsdp_problem(perf.cudagraphs_source, ctx.decided.strategy)
    if beside_fsdp is not None:
        problems.append(beside_fsdp)
    return problems


def apply_compile(model: nn.Module, perf: PerformanceConfig, dynamic: bool, cuda_graphs: bool = False) -> dict[str, Any]:
    """Compile ``model`` in the configured scope (``dynamic``: micro-batches of varying widths;
    ``cuda_graphs``: the plan's decision); returns what was done, for optimizations.json."""
    cache_dir, chosen_by_hone = configure_cache_dir()
    if perf.torch_compile_scope == "regional":
        details = compile_regional(model, perf, dynamic, cuda_graphs)
    else:
        details = compile_model(model, perf, dynamic, cuda_graphs)
    details["mode"] = perf.torch_compile_mode or "default"
    details["user_options"] = dict(perf.torch_compile_options)
    details["cache_dir"] = str(cache_dir)
    details["cache_dir_from"] = "hone default" if chosen_by_hone else "TORCHINDUCTOR_CACHE_DIR"
    return details


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    details = apply_compile(model, ctx.cfg.performance, ctx.facts.lengths_vary, ctx.decided.cuda_graphs)
    details["why"] = ctx.decided.compile_why
    details["cuda_graphs"] = ctx.decided.cuda_graphs
    details["cuda_graphs_why"] = ctx.decided.cuda_graphs_why
    return details


def _skipped(ctx: PlanContext) -> str | None:
    """``auto`` written in the config, off this device (the default's choice is in the decisions)."""
    perf = ctx.cfg.performance
    if perf.torch_compile == "auto" and perf.explicitly_set("torch_compile") and ctx.facts.device.type != "cuda":
        return f"torch_compile: auto compiles on CUDA only; this run trains on {ctx.facts.device.type}"
    return None


def _label(d: dict[str, Any]) -> str:
    extra = f"{d['scope']}"
    if d.get("layers"):
        extra += f", {d['layers']} layers"
    extra += f", {d['backend']}"
    if d.get("mode") not in (None, "default"):
        extra += f", mode {d['mode']}"
    if d.get("user_options"):
        extra += ", " + ", ".join(f"{k}={v}" for k, v in d["user_options"].items())
    if d.get("cuda_graphs") and "triton.cudagraphs" not in (d.get("user_options") or {}):
        extra += ", CUDA graphs"
    return f"compile ({extra})"


COMPILE = Transform(
    name="compile",
    switch="performance.torch_compile",
    wanted=lambda ctx: ctx.decided.compile,
    check=_check,
    why=lambda ctx: f"{ctx.decided.compile_why}; {ctx.decided.cuda_graphs_why}",
    model=_apply,
    skipped_because=_skipped,
    label=_label,
)
