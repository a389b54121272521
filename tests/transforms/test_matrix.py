"""The composability matrix (issue 11): every activation checkpointing policy x compile x
packing x adapter trains like the plain run.

Each cell of {none, full, selective, offload} x {compile off, on} x {packing off, on} x {LoRA,
full fine-tune} trains a tiny float32 model for a few steps through ``run_training`` (the path
``hone train`` takes: data preparation, the planner, the loader, the loop, the final save) and
must give, step for step, the losses, gradient norms and trained-token counts of the plain cell
(``none``, compile off) with the same packing and adapter, and the same final trained weights.
The plain runs train once per module (a cache), and the plain cell itself trains again and must
repeat its reference exactly: a matrix of tolerances means nothing if two identical runs differ.

Compile runs on the CPU with the ``aot_eager`` backend (Dynamo and AOTAutograd trace for real,
no code generation: Inductor on a 2-core CPU costs minutes), so ``selective`` here is torch's
selective checkpointing; under Inductor it is the compiler's activation memory budget instead
(the last test checks that switch; tests/gpu/test_checkpointing_gpu.py its gradients).

Offload: hone offloads only tensors of at least 1 MiB (``DEFAULT_MIN_BYTES``), and a tiny
model's layer inputs are a few KiB, so ``run_training`` as such would offload nothing and an
``offload`` cell would only be ``full`` again. The offload cells lower that threshold to one byte
(the one default the plan passes to ``apply_activation_checkpointing``; everything else is the
run's own path) and assert, for every micro-batch of the run, that the offloader moved exactly
the decoder layers' inputs to the host.
"""

import dataclasses
import io
import json
import random
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from hone.config import parse_config
from hone.run_files import OPTIMIZATIONS_FILE
from hone.train.run import run_training
from hone.transforms import checkpointing
from hone.transforms.base import RunFacts
from hone.transforms.planner import plan_optimizations

POLICIES = ["none", "full", "selective", "offload"]
COMPILE = {"off": {"torch_compile": False}, "on": {"torch_compile": True, "torch_compile_backend": "aot_eager"}}
PACKING = ["unpacked", "packed"]
ADAPTERS = ["lora", "full"]

STEPS = 3
MICRO_BATCH = 2
SEQUENCE_LEN = 32
ROW_LEN = 20  # the unpacked rows (see _write_data)
HIDDEN = 64  # the tiny presets' hidden size
LAYERS = 2

# The optimizer: AdamW at a learning rate where LoRA's zero-initialised B moves (from step 2 on
# the loss depends on the adapter, so the later steps test the adapters' gradients), with a large
# epsilon. With Adam's default 1e-8 the first update is lr * sign(g): a gradient element near
# zero whose sign is rounding noise moves its weight by 2 * lr, and the next losses with it.
# Measured here: scaling the offloaded layer inputs by (1 + 1e-6) moved the final weights by
# 6.5e-3 and the losses or grad norms by 2.4e-5 (relative) with epsilon 1e-8, but by 1.4e-5 and
# 1.5e-6 with epsilon 1e-3, where the update is smooth in the gradient: a comparison at fp32
# tolerance then tests the gradients, not luck. The transforms under test never see the optimizer.
LR = 2e-2
ADAM_EPS = 1e-3

# Tolerances against the plain cell. Eager checkpointing recomputes the same ops on the same
# inputs, and aot_eager runs the same aten kernels as eager (it generates no code), so compiled
# cells need no looser bound than eager ones: on the 2-core CPU this was written on, every cell
# is bit-identical to its plain run (losses, grad norms and final weights). The fp32 bound of
# the issue, 1e-5 relative, on the losses and grad norms leaves room for a torch or CPU whose
# kernels round a recompute or a traced graph differently (rounding moves them by ~1e-7; the
# probe above, 8 ulps on one tensor, by 1.5e-6). The weights are compared to 1e-4 of each
# tensor's largest weight: three Adam steps amplify a gradient's relative error about tenfold
# (1.4e-5 for that probe). Composition bugs are far outside both: comparing with the other
# adapter's plain run misses by 6e-3 or more, a 1e-4 error on the offloaded inputs by 1.4e-4.
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4


def _write_data(directory: Path) -> dict[str, Path]:
    """Seeded pretokenized rows with masked prompts (labels -100).

    Unpacked: rows of one length, so every micro-batch has one shape and compile traces static
    shapes (rows of varying lengths make the planner compile with dynamic shapes, about 8 s of
    tracing per compiled cell on a 2-core CPU; tests/integration/test_compile_run.py covers
    them). Packed: documents of 4 to 20 tokens, so bins of 32 hold two to five documents whose
    boundaries move from row to row.
    """
    rng = random.Random(11)

    def row(length: int) -> dict:
        ids = [rng.randint(5, 90) for _ in range(length)]
        prompt = rng.randint(0, length // 3)
        return {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}

    paths = {"unpacked": directory / "rows.jsonl", "packed": directory / "docs.jsonl"}
    paths["unpacked"].write_text("".join(json.dumps(row(ROW_LEN)) + "\n" for _ in range(16)))
    paths["packed"].write_text("".join(json.dumps(row(rng.randint(4, 20))) + "\n" for _ in range(40)))
    return paths


@dataclasses.dataclass
class Run:
    steps: list[tuple[float, float, int]]  # (loss, grad norm, trained tokens) per optimizer step
    weights: dict[str, torch.Tensor]  # what final/ holds: the adapter, or the whole model
    record: dict  # optimizations.json


class Trainer:
    """Trains one cell through ``run_training``; the data and its prepared cache are shared."""

    def __init__(self, root: Path):
        self.root = root
        self.data = _write_data(root)
        self.cache = root / "cache"
        self.runs = 0

    def config(
        self, policy: str, compile_: str, packing: str, adapter: str, tiled_mlp: str | int = "off", run_layers: str | int = "auto"
    ):
        self.runs += 1
        return parse_config(
            {
                "model": {"preset": "tiny-qwen3", "dtype": "float32", "attn_implementation": "sdpa"},
                "data": {
                    "datasets": [{"path": str(self.data[packing]), "type": "pretokenized"}],
                    "sequence_len": SEQUENCE_LEN,
                    "sample_packing": packing == "packed",
                    "dataset_prepared_path": str(self.cache),
                },
                "adapter": {"type": "lora", "lora_r": 4, "lora_target_modules": "all-linear"}
                if adapter == "lora"
                else {"type": "none"},
                "training": {
                    "max_steps": STEPS,
                    "micro_batch_size": MICRO_BATCH,
                    "seed": 3,
                    "output_dir": str(self.root / f"run{self.runs}-{policy}-{compile_}-{packing}-{adapter}"),
                },
                "optimizer": {"learning_rate": LR, "adam_epsilon": ADAM_EPS, "lr_scheduler": "constant"},
                "memory": {"activation_checkpointing": policy, "tiled_mlp": tiled_mlp, "checkpoint_run_layers": run_layers},
                "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
                "performance": COMPILE[compile_],
            }
        )

    def train(
        self, policy: str, compile_: str, packing: str, adapter: str, tiled_mlp: str | int = "off", run_layers: str | int = "auto"
    ) -> Run:
        cfg = self.config(policy, compile_, packing, adapter, tiled_mlp, run_layers)
        steps = []
        run_training(
            cfg,
            device="cpu",
            console=Console(file=io.StringIO(), width=300),
            step_callback=lambda m: steps.append((m.loss, m.grad_norm, m.trained_tokens)),
        )
        out = Path(cfg.training.output_dir)
        weights_file = "adapter_model.safetensors" if adapter == "lora" else "model.safetensors"
        return Run(steps, load_file(str(out / "final" / weights_file)), json.loads((out / OPTIMIZATIONS_FILE).read_text()))


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> Trainer:
    return Trainer(tmp_path_factory.mktemp("matrix"))


@pytest.fixture(scope="module")
def plain_runs(trainer):
    """The plain run (``none``, compile off) of each packing and adapter, trained once."""
    cache: dict[tuple[str, str], Run] = {}

    def get(packing: str, adapter: str) -> Run:
        if (packing, adapter) not in cache:
            cache[packing, adapter] = trainer.train("none", "off", packing, adapter)
        return cache[packing, adapter]

    return get


@pytest.fixture
def offload_tracked(monkeypatch):
    """Offload at any size, and the offloader's stats of every micro-batch of the run."""
    real_apply = checkpointing.apply_activation_checkpointing
    real_context = checkpointing.offload_step_context
    seen: list = []

    def apply(model, policy, **kwargs):
        kwargs["offload_min_bytes"] = 1  # a tiny model's layer inputs are KiBs, not MiBs
        return real_apply(model, policy, **kwargs)

    @contextmanager
    def context(model):
        with real_context(model):
            yield
        offloader = checkpointing.offloader_for(model)
        if offloader is not None:
            seen.append(dataclasses.replace(offloader.stats, shapes=list(offloader.stats.shapes)))

    # the checkpointing transform looks both names up in its module when it runs
    monkeypatch.setattr(checkpointing, "apply_activation_checkpointing", apply)
    monkeypatch.setattr(checkpointing, "offload_step_context", context)
    return seen


def _applied(record: dict) -> dict[str, dict]:
    return {a["name"]: a["details"] for a in record["applied"]}


def _assert_same_training(got: Run, want: Run, rtol: float, weight_rtol: float) -> None:
    assert len(want.steps) == len(got.steps) == STEPS
    want_t, got_t = torch.tensor(want.steps, dtype=torch.float64), torch.tensor(got.steps, dtype=torch.float64)
    assert torch.isfinite(want_t).all()
    assert got_t[:, 2].tolist() == want_t[:, 2].tolist(), "trained tokens per step"
    torch.testing.assert_close(got_t[:, 0], want_t[:, 0], rtol=rtol, atol=0, msg=lambda m: f"losses per step: {m}")
    torch.testing.assert_close(got_t[:, 1], want_t[:, 1], rtol=rtol, atol=0, msg=lambda m: f"grad norms per step: {m}")
    assert got.weights.keys() == want.weights.keys() and want.weights
    for name, ref in want.weights.items():
        scale = ref.abs().max().item()
        assert scale > 0, f"{name}: all zeros after training"  # LoRA's B included: the adapter trained
        torch.testing.assert_close(got.weights[name], ref, rtol=0, atol=weight_rtol * scale, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("packing", PACKING)
@pytest.mark.parametrize("compile_", list(COMPILE), ids=lambda c: f"compile-{c}")
@pytest.mark.parametrize("policy", POLICIES)
def test_every_cell_trains_like_the_plain_run(request, trainer, plain_runs, policy, compile_, packing, adapter):
    plain = plain_runs(packing, adapter)
    offloaded = request.getfixturevalue("offload_tracked") if policy == "offload" else None
    torch._dynamo.reset()  # the plain run may have been trained inside this test
    got = trainer.train(policy, compile_, packing, adapter)

    # the plain run learns, and from step 2 on through the adapter (LoRA's B starts at zero)
    losses = [s[0] for s in plain.steps]
    assert len(set(losses)) == STEPS, losses

    # the cell is what it claims to be
    applied = _applied(got.record)
    if policy == "none":
        assert "activation_checkpointing" not in applied
    else:
        checkpointed = applied["activation_checkpointing"]
        assert checkpointed["policy"] == policy and checkpointed["layers"] == LAYERS
    if compile_ == "on":
        details = applied["compile"]
        assert details["backend"] == "aot_eager" and details["scope"] == "regional" and details["dynamic_shapes"] is False
        stats = got.record["compile"]
        assert stats["counted"] and stats["forward_graphs"] >= 1 and stats["recompiles"] == 0, stats
    else:
        assert "compile" not in applied
    width = SEQUENCE_LEN if packing == "packed" else ROW_LEN
    if offloaded is not None:
        assert applied["activation_checkpointing"]["offload"]["min_bytes"] == 1
        # every micro-batch moved each layer's input to the host; with LoRA layer 0's input is the
        # frozen embedding's output, a leaf autograd holds on the device anyway, so it stays
        moved = LAYERS - 1 if adapter == "lora" else LAYERS
        assert len(offloaded) == STEPS
        for stats in offloaded:
            assert stats.packed == moved and stats.shapes == [(MICRO_BATCH, width, HIDDEN)] * moved, stats
            assert stats.packed_bytes == moved * MICRO_BATCH * width * HIDDEN * 4

    if (policy, compile_) == ("none", "off"):  # the plain cell repeats its reference exactly
        _assert_same_training(got, plain, rtol=0.0, weight_rtol=0.0)
    else:
        _assert_same_training(got, plain, rtol=LOSS_RTOL, weight_rtol=WEIGHT_RTOL)


#: Tiled MLP cells: every policy x compile with LoRA on packed rows, and full fine-tune on
#: unpacked rows without and with full checkpointing. 3 shards of 2 x 32 or 2 x 20 tokens: the
#: last shard is shorter, and shards cross row boundaries.
TILED_CELLS = [(policy, compile_, "packed", "lora") for policy in POLICIES for compile_ in COMPILE] + [
    ("none", "off", "unpacked", "full"),
    ("full", "on", "unpacked", "full"),
]


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(("policy", "compile_", "packing", "adapter"), TILED_CELLS, ids=lambda v: str(v))
def test_tiled_mlp_cells_train_like_the_plain_run(request, trainer, plain_runs, policy, compile_, packing, adapter):
    plain = plain_runs(packing, adapter)
    offloaded = request.getfixturevalue("offload_tracked") if policy == "offload" else None
    torch._dynamo.reset()
    got = trainer.train(policy, compile_, packing, adapter, tiled_mlp=3)
    applied = _applied(got.record)
    assert applied["tiled_mlp"]["shards"] == 3 and applied["tiled_mlp"]["layers"] == LAYERS
    names = [a["name"] for a in got.record["applied"]]
    assert names.index("tiled_mlp") < names.index("compile" if compile_ == "on" else "loss")
    if policy != "none":
        assert applied["activation_checkpointing"]["policy"] == policy
    if compile_ == "on":
        stats = got.record["compile"]
        assert stats["counted"] and stats["recompiles"] == 0, stats
    if offloaded is not None:
        assert len(offloaded) == STEPS and all(stats.packed == LAYERS - 1 for stats in offloaded)
    _assert_same_training(got, plain, rtol=LOSS_RTOL, weight_rtol=WEIGHT_RTOL)


#: Layer-run cells (both layers in one run: the second layer's input rebuilt in the backward):
#: packed rows (the document mask or boundaries reach the rebuild), compiled and eager, offload
#: (full fine-tune: layer 0's input is no leaf, so the offloader moves the run's first input).
RUN_CELLS = [("full", "on", "packed", "lora"), ("offload", "on", "packed", "full"), ("offload", "off", "unpacked", "lora")]


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(("policy", "compile_", "packing", "adapter"), RUN_CELLS, ids=lambda v: str(v))
def test_layer_run_cells_train_like_the_plain_run(request, trainer, plain_runs, policy, compile_, packing, adapter):
    plain = plain_runs(packing, adapter)
    offloaded = request.getfixturevalue("offload_tracked") if policy == "offload" else None
    torch._dynamo.reset()
    got = trainer.train(policy, compile_, packing, adapter, run_layers=2)
    applied = _applied(got.record)
    assert applied["layer_runs"]["layers_per_run"] == 2 and applied["layer_runs"]["runs"] == 1
    if compile_ == "on":
        stats = got.record["compile"]
        assert stats["counted"] and stats["recompiles"] == 0, stats
    if offloaded is not None:  # one input per run: under LoRA the run's first is a leaf the device keeps
        assert len(offloaded) == STEPS and all(stats.packed == (adapter == "full") for stats in offloaded)
    _assert_same_training(got, plain, rtol=LOSS_RTOL, weight_rtol=WEIGHT_RTOL)


def test_selective_under_inductor_is_the_compilers_memory_budget(tokenizer):
    """Under Inductor, selective is not torch's checkpoint wrapper (its cache would see Inductor's
    kernels overwrite buffers) but the partitioner's activation memory budget, set around each
    micro-batch: the layers stay unwrapped and the record says which mechanism ran."""
    import torch._functorch.config as functorch_config

    from hone.testing import tiny_model

    cfg = parse_config(
        {
            "model": {"preset": "tiny-qwen3"},
            "data": {"datasets": [{"path": "unused.jsonl", "type": "pretokenized"}]},
            "memory": {"activation_checkpointing": "selective", "selective_memory_budget": 0.3},
            "performance": {"torch_compile": True, "torch_compile_backend": "inductor"},
        }
    )
    facts = RunFacts(torch.device("cpu"))
    plan = plan_optimizations(cfg, facts)
    assert plan.names == ["attention", "fused_lora_linear", "loss", "activation_checkpointing", "compile"]  # tiled_mlp: auto, off
    model = tiny_model("tiny-qwen3", tokenizer)
    plan.apply(model, "base", cfg, facts)
    (applied,) = [a for a in plan.apply(model, "adapted", cfg, facts) if a.name == "activation_checkpointing"]
    assert applied.details["activation_memory_budget"] == 0.3 and "partitioner" in applied.details["mechanism"]
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    hooks = plan.hooks(model, cfg, facts)
    before = functorch_config.activation_memory_budget
    with hooks.step_context(None):
        assert functorch_config.activation_memory_budget == 0.3
    assert functorch_config.activation_memory_budget == before
