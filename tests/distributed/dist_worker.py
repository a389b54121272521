"""What each process of the distributed tests runs (under torchrun), and the same cases on one
process for the reference (imported by the tests).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed/dist_worker.py SCENARIO OUT SEED

Scenarios: ``parity`` (LoRA and full fine-tune, with and without packing, with eval),
``composed`` (the same through the plan with regional compile and full checkpointing),
``resume`` (a straight run, one that stops after its step-2 checkpoint, and its resume),
``startup_failure`` (rank 1 fails inside a start-up phase). Each writes what the tests compare
under OUT (weights per rank, outcome files); metrics come from the runs' own metrics.jsonl.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from rich.console import Console

from hone.errors import HoneError
from hone.runtime.world import SINGLE, World  # noqa: F401 -- SINGLE is re-exported to the tests
from hone.testing import plan_hooks, random_rows, tiny_config, tiny_llama, with_random_lora
from hone.train.distributed import close_world, init_world, together  # noqa: F401 -- SINGLE is re-exported to the tests
from hone.train.loop import train_loop

CPU = torch.device("cpu")
CASES = [(adapter, packed) for adapter in ("lora", "full") for packed in (False, True)]
STEPS = 3
#: Micro-batches per rank and step in the 2-process runs; the one-process reference takes 2x.
ACCUMULATION = 1


class Crash(Exception):
    """The simulated death of a run right after a checkpoint (both ranks at the same step)."""


def case_name(adapter: str, packed: bool) -> str:
    return f"{adapter}-{'packed' if packed else 'padded'}"


def make_model(adapter: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # PEFT draws LoRA's A matrices from the global generator
    model = tiny_llama(seed, freeze_embeddings=adapter == "lora")
    if adapter == "lora":
        model = with_random_lora(model, seed)
    return model


def make_data(seed: int):
    return random_rows(40, seed=seed, min_len=5, max_len=24), random_rows(7, seed=seed + 1, min_len=5, max_len=24)


def make_config(out: Path, packed: bool, accumulation: int, sections: dict | None = None, **training):
    return tiny_config(
        out,
        data={"val_set_size": 0.1, **({"sample_packing": True, "sequence_len": 48} if packed else {})},
        training={
            "max_steps": STEPS,
            "micro_batch_size": 1,
            "gradient_accumulation_steps": accumulation,
            "eval_steps": STEPS,
            "save_steps": None,
            **training,
        },
        optimizer={"learning_rate": 5e-3, "lr_scheduler": "constant", "weight_decay": 0.01, "fused": False},
        **(sections or {}),
    )


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_case(adapter: str, packed: bool, out: Path, seed: int, world: World, accumulation: int) -> torch.nn.Module:
    """One training run of a parity case (every rank calls it); returns the trained model."""
    model = make_model(adapter, seed)
    train, evaluation = make_data(seed)
    cfg = make_config(out, packed, accumulation)
    train_loop(
        model,
        train,
        evaluation,
        cfg,
        device=CPU,
        pad_id=0,
        console=Console(quiet=True),
        world=world,
        hooks=plan_hooks(model, cfg, CPU, world),
    )
    return model


#: Compile (regional, aot_eager on the CPU) and full activation checkpointing under DDP.
COMPOSED = {
    "performance": {"torch_compile": True, "torch_compile_backend": "aot_eager", "torch_compile_scope": "regional"},
    "memory": {"activation_checkpointing": "full"},
}


def run_composed_case(adapter: str, out: Path, seed: int, world: World, accumulation: int) -> torch.nn.Module:
    """A parity case through the whole plan: compile and checkpointing applied to the model, then
    DDP around them (what ``run_training`` does)."""
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    torch._dynamo.reset()
    model = make_model(adapter, seed)
    train, evaluation = make_data(seed)
    cfg = make_config(out, True, accumulation, COMPOSED)  # packed: one shape, one compilation
    facts = RunFacts(CPU, world=world, shape_note="packed documents move")
    plan = plan_optimizations(cfg, facts)
    plan.apply(model, "adapted", cfg, facts)
    hooks = plan.hooks(model, cfg, facts)
    assert {"compile", "activation_checkpointing"} <= set(plan.names), plan.names
    train_loop(model, train, evaluation, cfg, device=CPU, pad_id=0, console=Console(quiet=True), world=world, hooks=hooks)
    return model


def resume_config(out: Path, accumulation: int, **training):
    return make_config(out, False, accumulation, max_steps=4, save_steps=2, **training)


def run_resume_case(out: Path, seed: int, world: World, accumulation: int, *, resume_from=None, crash_at=None):
    model = make_model("lora", seed)
    train, evaluation = make_data(seed)

    def crash(metrics):
        if crash_at is not None and metrics.step == crash_at:
            raise Crash

    cfg = resume_config(out, accumulation)
    train_loop(
        model,
        train,
        evaluation,
        cfg,
        device=CPU,
        pad_id=0,
        console=Console(quiet=True),
        world=world,
        resume_from=resume_from,
        step_callback=crash,
        hooks=plan_hooks(model, cfg, CPU, world),
    )
    return model


def _parity(world: World, out: Path, seed: int) -> None:
    for adapter, packed in CASES:
        model = run_case(adapter, packed, out / case_name(adapter, packed), seed, world, ACCUMULATION)
        torch.save(trainable(model), out / case_name(adapter, packed) / f"weights-rank{world.rank}.pt")


def _composed(world: World, out: Path, seed: int) -> None:
    for adapter in ("lora", "full"):
        model = run_composed_case(adapter, out / adapter, seed, world, ACCUMULATION)
        torch.save(trainable(model), out / adapter / f"weights-rank{world.rank}.pt")


def _resume(world: World, out: Path, seed: int) -> None:
    model = run_resume_case(out / "straight", seed, world, ACCUMULATION)
    torch.save(trainable(model), out / "straight" / f"weights-rank{world.rank}.pt")
    try:
        run_resume_case(out / "crashed", seed, world, ACCUMULATION, crash_at=3)
    except Crash:
        pass
    with together(world):
        if world.is_main:  # a pristine copy for the 2 -> 1 resume the test runs itself
            shutil.copytree(out / "crashed", out / "crashed-copy")
    model = run_resume_case(out / "crashed", seed, world, ACCUMULATION, resume_from=out / "crashed" / "checkpoints" / "step-2")
    torch.save(trainable(model), out / "crashed" / f"weights-rank{world.rank}.pt")


def _startup_failure(world: World, out: Path, seed: int) -> None:
    outcome: dict = {"rank": world.rank}
    try:
        with together(world):
            if world.rank == 1:
                raise HoneError("data file shard-1.jsonl is missing on this host")
        outcome["result"] = "no error"
    except HoneError as exc:
        outcome.update(result=type(exc).__name__, message=str(exc), exit_code=exc.exit_code, quiet=getattr(exc, "quiet", False))
    (out / f"outcome-rank{world.rank}.json").write_text(json.dumps(outcome))


def _midrun_failure(world: World, out: Path, seed: int) -> None:
    """Rank 1 dies during step 2 while rank 0 goes on into step 3's collectives."""

    def die(metrics):
        if world.rank == 1 and metrics.step == 2:
            raise RuntimeError("simulated failure of rank 1 at step 2")

    cfg = make_config(out, False, ACCUMULATION, max_steps=50)
    train, evaluation = make_data(seed)
    model = make_model("lora", seed)
    train_loop(
        model,
        train,
        None,
        cfg,
        device=CPU,
        pad_id=0,
        console=Console(quiet=True),
        world=world,
        step_callback=die,
        hooks=plan_hooks(model, cfg, CPU, world),
    )


def _nonfinite(world: World, out: Path, seed: int) -> None:
    """Rank 1's weights turn to NaN after DDP's initial broadcast: its local loss is NaN, rank 0's
    is finite. Both must skip the same steps (decided on the all-reduced loss) and stop together."""
    from contextlib import nullcontext

    from hone.train.loop import NonFiniteLossError
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    model = make_model("lora", seed)
    before = trainable(model)
    train, _ = make_data(seed)
    cfg = make_config(out, False, ACCUMULATION, max_steps=6, max_consecutive_nonfinite=2, eval_steps=None)
    facts = RunFacts(CPU, world=world)
    hooks = plan_optimizations(cfg, facts).hooks(model, cfg, facts)
    poisoned = []

    def poison(batch):
        if world.rank == 1 and not poisoned:
            with torch.no_grad():
                next(p for n, p in model.named_parameters() if "lora_B" in n).fill_(float("nan"))
            poisoned.append(True)
        return nullcontext()

    hooks.step_contexts.append(lambda batch: poison(batch))
    outcome: dict = {"rank": world.rank}
    steps = []
    try:
        train_loop(
            model,
            train,
            None,
            cfg,
            device=CPU,
            pad_id=0,
            console=Console(quiet=True),
            world=world,
            hooks=hooks,
            step_callback=lambda m: steps.append((m.step, m.skipped)),
        )
        outcome["result"] = "finished"
    except NonFiniteLossError as exc:
        outcome["result"] = "NonFiniteLossError"
        outcome["message"] = str(exc)
    outcome["steps"] = steps
    outcome["unchanged"] = all(torch.equal(before[k], v) for k, v in trainable(model).items()) if world.rank == 0 else None
    (out / f"outcome-rank{world.rank}.json").write_text(json.dumps(outcome))


SCENARIOS = {
    "parity": _parity,
    "nonfinite": _nonfinite,
    "composed": _composed,
    "midrun_failure": _midrun_failure,
    "resume": _resume,
    "startup_failure": _startup_failure,
}


def main() -> None:
    scenario, out, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    world = init_world("cpu")
    try:
        SCENARIOS[scenario](world, out, seed)
    finally:
        close_world()


if __name__ == "__main__":
    main()
