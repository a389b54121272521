"""Expert-parallel training cases: what each of 2 gloo ranks runs, and the same cases on one
process for the reference (imported by tests/distributed/test_expert_parallel_training.py).

A tiny Qwen3-MoE (8 experts, top-2): the reference is the whole model in one process, its
experts computed by transformers (``grouped_mm``, PEFT's own expert LoRA); the expert-parallel
run builds the same model from the same seed, keeps each rank's 4 experts through the plan's
``experts`` and ``expert_parallel`` transforms, attaches the same adapter (PEFT then makes the
factors of the local experts only) and copies the reference's initial adapter into it, each
rank its block (the reference's B matrices are random instead of PEFT's zeros; that the A
matrices PEFT draws already match is tested in tests/unit/test_expert_parallel_setup.py).
Cases: LoRA and full fine-tune, padded and packed; gpt-oss' experts (biases, transposed
layout); a capacity below ``T * k``; MXFP4 experts (``model.quantize: mxfp4``: the reference
quantizes its experts and runs hone's experts forward, the ranks quantize through the plan and
keep their block of the blocks and scales); and, slow, regional compile with full checkpointing.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

from hone.config.adapter import AdapterConfig
from hone.models.adapters import apply_adapter
from hone.models.experts.parallel import expert_parallel_names, expert_shard, join_blocks, local_block
from hone.models.presets import build_preset_config
from hone.runtime.world import World
from hone.testing import VOCAB, random_rows, tiny_config
from hone.train.loop import train_loop
from hone.transforms.base import PlanContext, RunFacts
from hone.transforms.planner import plan_optimizations

CPU = torch.device("cpu")
STEPS = 3
LORA = AdapterConfig(type="lora", lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj", "o_proj", "experts"])
#: Regional compile (aot_eager on the CPU) and full activation checkpointing, applied by the plan.
COMPOSED = {
    "performance": {"torch_compile": True, "torch_compile_backend": "aot_eager", "torch_compile_scope": "regional"},
    "memory": {"activation_checkpointing": "full"},
}


@dataclass(frozen=True)
class Case:
    adapter: str  # lora (attention + experts) or full
    packed: bool
    preset: str = "tiny-qwen3-moe"
    composed: bool = False  # through the plan's compile and checkpointing
    capacity_factor: float | None = None  # distributed.expert_capacity_factor (None: T * k)
    fsdp: bool = False  # FSDP2 beside expert parallelism (distributed.strategy: fsdp), else DDP
    quantize: str = "none"  # model.quantize (mxfp4: the experts in MXFP4, LoRA only)
    chunks: int = 1  # distributed.expert_parallel_chunks
    recompute: bool = False  # distributed.expert_parallel_recompute

    @property
    def name(self) -> str:
        extra = ("-gpt-oss" if "gpt-oss" in self.preset else "") + ("-composed" if self.composed else "")
        extra += f"-capacity-{self.capacity_factor}" if self.capacity_factor is not None else ""
        extra += "-fsdp" if self.fsdp else ""
        extra += f"-{self.quantize}" if self.quantize != "none" else ""
        extra += f"-chunks-{self.chunks}" if self.chunks != 1 else ""
        extra += "-recompute" if self.recompute else ""
        return f"{self.adapter}-{'packed' if self.packed else 'padded'}{extra}"


CASES = [Case(adapter, packed) for adapter in ("lora", "full") for packed in (False, True)]
#: gpt-oss' experts: transposed, interleaved gate/up, biases (split with the experts), clamped SwiGLU.
GPT_OSS = Case("full", False, "tiny-gpt-oss")
#: Buffers sized for 48 tokens, top-2: 48 slots per pair of ranks instead of 96; padded rows hold
#: at most 24 tokens (48 pairs), so none overflows however skewed the tiny router is (it is).
CAPPED = Case("lora", False, capacity_factor=1.0)
#: Compiled and checkpointed; the LoRA case exchanges its tokens in two chunks (the traced
#: functional collectives of each chunk) and recomputes its local experts in the backward (a
#: checkpoint traced inside the compiled layer), the full one in one chunk, kept.
SLOW_CASES = [Case("lora", True, composed=True, chunks=2, recompute=True), Case("full", True, composed=True, fsdp=True)]
#: FSDP2 shards everything outside the experts (attention, router, norms, embeddings, head).
FSDP_CASES = [Case("lora", True, fsdp=True), Case("full", False, fsdp=True)]


def make_config(
    out: Path, case: Case, accumulation: int, expert_parallel: int, save_steps: int | None = None, fsdp_alone: bool = False
):
    """The case's config; ``fsdp_alone``: FSDP2 without expert parallelism (``expert_parallel`` 1)."""
    return tiny_config(
        out,
        model={"preset": case.preset, "dtype": "float32", **({"quantize": case.quantize} if case.quantize != "none" else {})},
        data={"val_set_size": 0.1, "sequence_len": 48, **({"sample_packing": True} if case.packed else {})},
        adapter={"type": "none"} if case.adapter == "full" else LORA.model_dump(),
        training={
            "max_steps": STEPS,
            "micro_batch_size": 1,
            "gradient_accumulation_steps": accumulation,
            "eval_steps": STEPS,
            "save_steps": save_steps,
            "max_grad_norm": 0.5,  # clips: the norm must be the global one on every rank
        },
        # adam_epsilon 1e-3, not 1e-8: AdamW divides by sqrt(v), which turns the float32 rounding
        # of near-zero gradients (a token seen once, summed in another order) into whole updates
        # (at 1e-5, seed 2604 moved one embedding weight of the full fine-tune by 1.6e-5)
        # fused beside FSDP2: one multi-tensor update per group, which refuses DTensors and plain tensors together
        optimizer={
            "learning_rate": 5e-3,
            "lr_scheduler": "constant",
            "weight_decay": 0.01,
            "fused": case.fsdp,
            "adam_epsilon": 1e-3,
        },
        distributed={"expert_parallel": expert_parallel, **({"strategy": "fsdp"} if fsdp_alone else {})}
        if expert_parallel == 1
        else {
            "expert_parallel": expert_parallel,
            "expert_capacity_factor": case.capacity_factor,
            "expert_parallel_chunks": case.chunks,
            "expert_parallel_recompute": case.recompute,
            **({"strategy": "fsdp"} if case.fsdp else {}),
        },
        **(COMPOSED if case.composed else {}),
    )


def base_model(preset: str, seed: int) -> torch.nn.Module:
    config = build_preset_config(preset, {}, VOCAB)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def reference_model(case: Case, seed: int) -> torch.nn.Module:
    """The whole model with its adapter (random B: a zero B makes every A gradient zero). MXFP4:
    every expert quantized, computed by hone's experts forward (its float32 reference on the CPU)."""
    model = base_model(case.preset, seed)
    if case.quantize == "mxfp4":
        from hone.models.experts import set_experts_implementation
        from hone.models.experts.mxfp4_quantize import quantize_model_experts

        quantize_model_experts(model, CPU)
        set_experts_implementation(model, "hone")
    if case.adapter == "full":
        return apply_adapter(model, AdapterConfig(type="none"))
    torch.manual_seed(seed)
    model = apply_adapter(model, LORA)
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.1
    return model


def expert_parallel_model(case: Case, seed: int, cfg, facts: RunFacts) -> torch.nn.Module:
    """This rank's model: the plan's quantize (MXFP4), experts and expert-parallel transforms on
    the base, the adapter, then the reference's initial trainable weights (each rank its block)."""
    plan = plan_optimizations(cfg, facts)
    assert "expert_parallel" in plan.names, plan.names
    model = base_model(case.preset, seed)
    ctx = PlanContext(cfg, facts, plan.decided)
    for transform in plan.transforms:
        if transform.name in ("quantize", "experts", "expert_parallel"):
            transform.model(model, ctx)
    model = apply_adapter(model, AdapterConfig(type="none") if case.adapter == "full" else LORA)
    copy_global(model, reference_model(case, seed))
    return model


def shards(model: torch.nn.Module) -> dict[str, object]:
    """Each sharded parameter's name -> the shard of the experts module it belongs to."""
    return {name: _owner_shard(model, name) for name in expert_parallel_names(model)}


def _owner_shard(model: torch.nn.Module, name: str):
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = model.get_submodule(".".join(parts[:cut]))
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        if expert_shard(base) is not None:
            return expert_shard(base)
    raise AssertionError(f"{name} belongs to no expert-parallel module")


def copy_global(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Set every trainable weight of ``model`` from ``reference``'s (the rank's block where sharded)."""
    sharded = set(expert_parallel_names(model))
    full = dict(reference.named_parameters())
    from hone.models.experts.mxfp4 import is_placeholder

    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_placeholder(param):  # an MXFP4 weight's stand-in: the blocks are the same quantized draw
                continue
            value = full[name].detach()
            if name in sharded:
                value = local_block(name, value, _owner_shard(model, name))
            assert value.shape == param.shape, (name, value.shape, param.shape)
            param.copy_(value)


def make_data(seed: int):
    return random_rows(40, seed=seed, min_len=5, max_len=24), random_rows(7, seed=seed + 1, min_len=5, max_len=24)


def run(model, cfg, world: World, facts: RunFacts, seed: int, resume_from: Path | None = None):
    """The plan's adapted stage (compile, checkpointing, FSDP2 where the case asks), then the
    loop (from a checkpoint where given); returns the plan's hooks."""
    torch._dynamo.reset()
    train, evaluation = make_data(seed)
    plan = plan_optimizations(cfg, facts)
    plan.apply(model, "adapted", cfg, facts)
    hooks = plan.hooks(model, cfg, facts)
    console = Console(quiet=True)
    loop_args = {"console": console, "world": world, "hooks": hooks, "resume_from": resume_from}
    train_loop(model, train, evaluation, cfg, device=CPU, pad_id=0, **loop_args)
    return hooks


def joined_weights(run_dir: Path, ranks: int, group: int | None = None) -> tuple[dict, dict]:
    """``(weights, sharded)``: the trained weights the ``ranks`` ranks saved (``weights-rank{r}.pt``)
    as one model's: the expert blocks of the first expert-parallel group (``group`` ranks; all of
    them by default) joined, every other weight checked equal on every rank, and every rank's
    block equal to the one at its position in the first group (its replicas)."""
    group = group or ranks
    saved = [torch.load(run_dir / f"weights-rank{r}.pt") for r in range(ranks)]
    sharded = saved[0]["sharded"]
    for rank, held in enumerate(saved):
        for name, weight in held["weights"].items():
            twin = saved[rank % group if name in sharded else 0]["weights"][name]
            torch.testing.assert_close(weight, twin, rtol=0, atol=0, msg=f"replicas differ: {name} (rank {rank})")
    joined = {
        name: join_blocks(name, [saved[r]["weights"][name] for r in range(group)], sharded[name]) if name in sharded else weight
        for name, weight in saved[0]["weights"].items()
    }
    return joined, sharded


def scramble_trainable(model: torch.nn.Module, rank: int) -> None:
    """Noise on every trainable weight before a resume: whatever the run then holds must come
    from the checkpoint."""
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(rank)))


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained weights, FSDP2's shards gathered whole (every rank must call it then)."""
    from torch.distributed.tensor import DTensor

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in named}


def run_reference(case: Case, out: Path, seed: int, final: Path | None = None) -> dict[str, torch.Tensor]:
    """One process, accumulation 2: the trained weights (and the final adapter or model written
    to ``final`` where given)."""
    from hone.models.save import save_final
    from hone.runtime.world import SINGLE

    cfg = make_config(out, case, accumulation=2, expert_parallel=1)
    model = reference_model(case, seed)
    run(model, cfg, SINGLE, RunFacts(CPU, world=SINGLE), seed)
    if final is not None:
        save_final(model, None, final, cfg.adapter)
    return trainable(model)


def resume_ranks(rank: int, out: Path, seed: int, cases: list[Case]) -> None:
    """Each case twice on this rank: uninterrupted with a checkpoint after step 2 (and its final
    output), then from that checkpoint in a model whose trained weights were scrambled first, to
    the end (and its final output); the trained weights of both, gathered."""
    from hone.runtime.world import current_world
    from hone.train.checkpoint_io import checkpoint_io_for

    world = current_world()
    facts = RunFacts(CPU, world=world)
    for case in cases:
        for part in ("whole", "resumed"):
            cfg = make_config(out / case.name / part, case, accumulation=1, expert_parallel=world.world_size, save_steps=2)
            model = expert_parallel_model(case, seed, cfg, facts)
            resume_from = None
            if part == "resumed":
                scramble_trainable(model, rank)
                resume_from = out / case.name / "whole" / "checkpoints" / "step-2"
            hooks = run(model, cfg, world, facts, seed, resume_from=resume_from)
            checkpoint_io_for(hooks, world).save_final(model, None, out / case.name / part / "final", cfg.adapter)
            torch.save(trainable(model), out / case.name / part / f"weights-rank{rank}.pt")


def resume_with_another_capacity(rank: int, out: Path, seed: int) -> None:
    """:data:`CAPPED` uninterrupted with a checkpoint after step 2, then resumed from it with
    buffers twice as large (what an overflow's error tells a user to do), in a model whose
    trained weights were scrambled first: nothing saved depends on the capacity."""
    from hone.runtime.world import current_world

    world = current_world()
    facts = RunFacts(CPU, world=world)
    wider = Case(CAPPED.adapter, CAPPED.packed, capacity_factor=2.0)
    for part, case in (("whole", CAPPED), ("resumed", wider)):
        cfg = make_config(out / part, case, accumulation=1, expert_parallel=world.world_size, save_steps=2)
        model = expert_parallel_model(case, seed, cfg, facts)
        resume_from = None
        if part == "resumed":
            scramble_trainable(model, rank)
            resume_from = out / "whole" / "checkpoints" / "step-2"
        run(model, cfg, world, facts, seed, resume_from=resume_from)
        torch.save(trainable(model), out / part / f"weights-rank{rank}.pt")


def scramble(model: torch.nn.Module, rank: int) -> None:
    """Add noise to the trainable weights: whatever a resumed run ends with must come from the checkpoint."""
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(rank)))


def resume_on_layout(
    rank: int,
    out: Path,
    seed: int,
    cases: list[Case],
    source: Path | None,
    expert_parallel: int,
    part: str = "",
    ddp: bool = False,
) -> None:
    """Each case resumed from ``source/<case>/<part>/checkpoints/step-2`` (written on another layout) on
    this rank: expert parallelism beside FSDP2 (or ``ddp``) over ``expert_parallel`` ranks, or (1) FSDP2 alone;
    to the end, with its final output in ``out/<case>/final``. No ``source``: from the start, with
    a checkpoint after step 2."""
    from hone.runtime.world import current_world
    from hone.train.checkpoint_io import checkpoint_io_for

    world = current_world()
    facts = RunFacts(CPU, world=world)
    for case in cases:
        alone = expert_parallel == 1
        layout = dataclasses.replace(case, fsdp=False) if ddp else case  # expert parallel beside DDP
        save = 2 if source is None else None
        cfg = make_config(out / case.name, layout, 1, expert_parallel=expert_parallel, save_steps=save, fsdp_alone=alone)
        model = reference_model(case, seed) if alone else expert_parallel_model(case, seed, cfg, facts)
        resume_from = None if source is None else source / case.name / part / "checkpoints" / "step-2"
        if resume_from is not None:
            scramble(model, rank)
        hooks = run(model, cfg, world, facts, seed, resume_from=resume_from)
        checkpoint_io_for(hooks, world).save_final(model, None, out / case.name / "final", cfg.adapter)


def run_ranks(rank: int, out: Path, seed: int, cases: list[Case]) -> None:
    """Each case on this rank (2 ranks, accumulation 1); writes each rank's trained weights
    and which of them are expert blocks (with their experts per rank)."""
    from hone.runtime.world import current_world

    world = current_world()
    facts = RunFacts(CPU, world=world)
    for case in cases:
        cfg = make_config(out / case.name, case, accumulation=1, expert_parallel=world.world_size)
        model = expert_parallel_model(case, seed, cfg, facts)
        run(model, cfg, world, facts, seed)
        sharded = {n: s.local_count for n, s in shards(model).items()}
        kinds = {n: type(p).__name__ for n, p in model.named_parameters() if p.requires_grad}
        saved = {"weights": trainable(model), "sharded": sharded, "kinds": kinds}
        torch.save(saved, out / case.name / f"weights-rank{rank}.pt")


def overflow_ranks(rank: int, out: Path, seed: int) -> None:
    """A capacity far too small for packed rows: every rank must stop at the first micro-batch
    with the same error (none left waiting in a collective)."""
    import json

    from hone.parallel.expert_parallel import ExpertCapacityError
    from hone.runtime.world import current_world

    world = current_world()
    facts = RunFacts(CPU, world=world)
    case = Case("full", True, capacity_factor=0.1)
    cfg = make_config(out, case, accumulation=1, expert_parallel=world.world_size)
    model = expert_parallel_model(case, seed, cfg, facts)
    outcome = {"rank": rank, "result": "finished"}
    try:
        run(model, cfg, world, facts, seed)
    except ExpertCapacityError as exc:
        outcome.update(result="ExpertCapacityError", message=str(exc))
    (out / f"outcome-rank{rank}.json").write_text(json.dumps(outcome))
