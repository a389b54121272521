"""A float8 full fine-tune under FSDP2 through ``hone train`` on 2 gloo processes, with torchao's
emulated float8 (``performance.fp8_emulate``: the quantization, the amax reductions and the float8
all-gather as on a GPU, the matmuls of the dequantized operands in high precision).

- 2 ranks equal 1 process with accumulation 2 (the same global batch): the float8 rounding
  happens at the same points in both (tensorwise scales from the whole weight's amax, reduced
  over the mesh; activations and gradients per micro-batch of the same rows), so what differs is
  the order of the gradient sums (FSDP2 reduces in float32) and of the loss's float32 sums. The
  weights are bfloat16: they may differ by at most one bfloat16 rounding step (relative 2**-7),
  the losses by float32 rounding (1e-5); bf16's usual 1e-2 would hide a wrong scale.
- a run whose ranks are SIGKILLed after a checkpoint resumes to the uninterrupted run's losses
  and weights: the resumed weights must not be quantized with float8 scales computed before the
  checkpoint was loaded (torch's ``set_state_dict`` steps the optimizer once to create its state,
  which runs the scale precomputation on the weights it is about to overwrite).
- the checkpoint and the final model hold plain bfloat16/float32 tensors: no float8 tensor, no
  torchao subclass; both load where torchao cannot be imported.
"""

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from dist_launch import REPO, TIMEOUT_S, child_env
from fsdp_harness import spawn, start
from killed_run import train_losses

STEPS = 10
SAVE_STEPS = 2


def _config(
    out: Path, name: str, strategy: str, accumulation: int, preset: str = "tiny-llama", expert_parallel: int = 1, **training
) -> Path:
    data = out / "data.jsonl"
    if not data.exists():
        rng = random.Random(1)
        rows = [{"input_ids": [rng.randint(5, 250) for _ in range(rng.randint(8, 40))]} for _ in range(64)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "model": {"preset": preset, "dtype": "bfloat16"},  # performance.fp8 needs bfloat16
        "data": {
            "datasets": [{"path": str(data), "type": "pretokenized"}],
            "sequence_len": 64,
            "dataset_prepared_path": str(out / "cache"),
        },
        "adapter": {"type": "none"},
        # float8 all-gather under FSDP2, scales precomputed after each step; emulated on the CPU
        "performance": {"fp8": "tensorwise", "fp8_emulate": True},
        "training": {
            "max_steps": STEPS,
            "save_steps": SAVE_STEPS,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": accumulation,
            "output_dir": str(out / name),
            "seed": 5,
            # no clipping: FSDP2's norm sums the shards' squares in another order than one
            # process's, and a clip coefficient one float32 ulp apart moved a bf16 weight by a
            # rounding step on an AVX2 CPU (losses 3e-4 apart by step 3); the norm's own
            # exactness is tested with the data-parallel norms (tests/distributed/test_fsdp_grads.py)
            "max_grad_norm": None,
            **training,
        },
        "optimizer": {"learning_rate": 5e-3, "fused": False},
        "distributed": {"strategy": strategy, "expert_parallel": expert_parallel},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
    }
    path = out / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(rank: int, cfg: Path) -> None:
    from hone.cli import main

    assert main(["train", str(cfg)]) == 0, f"hone train {cfg} failed on rank {rank}"


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "final" / "model.safetensors")


def _kill_after_checkpoint(cfg: Path, step: int) -> int:
    """Run ``cfg`` on 2 ranks and SIGKILL both once ``step``'s checkpoint is complete; returns the
    newest complete checkpoint's step."""
    run = Path(yaml.safe_load(cfg.read_text())["training"]["output_dir"])
    context = start(_train, 2, cfg)
    deadline = time.monotonic() + TIMEOUT_S
    while not (run / "checkpoints" / f"step-{step}" / "COMPLETE").exists():
        assert all(p.is_alive() for p in context.processes), "a rank ended before the kill"
        assert time.monotonic() < deadline, f"no complete checkpoint at step {step} after {TIMEOUT_S} s"
        time.sleep(0.01)
    for process in context.processes:
        process.kill()
    for process in context.processes:
        process.join(timeout=30)
    assert not (run / "final").exists(), "the run finished before the kill: give it more steps"
    return max(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The uninterrupted 2-rank FSDP2 run, and the same global batch on 1 process (accumulation 2)."""
    out = tmp_path_factory.mktemp("fp8-fsdp")
    spawn(_train, 2, _config(out, "fsdp", "fsdp", 1), timeout_s=TIMEOUT_S)
    spawn(_train, 1, _config(out, "single", "none", 2), timeout_s=TIMEOUT_S)
    return out


def test_two_fsdp2_ranks_equal_one_process_with_twice_the_accumulation(runs):
    fsdp, single = train_losses(runs / "fsdp"), train_losses(runs / "single")
    assert sorted(fsdp) == sorted(single) == list(range(1, STEPS + 1))
    assert [fsdp[s] for s in fsdp] == pytest.approx([single[s] for s in fsdp], rel=1e-5)
    applied = json.loads((runs / "fsdp" / "optimizations.json").read_text())
    fp8 = next(t for t in applied["applied"] if t["name"] == "fp8")
    assert fp8["details"]["fsdp_float8_all_gather"] and fp8["details"]["emulated"] and fp8["details"]["converted"] == 14
    got, want = _final_weights(runs / "fsdp"), _final_weights(runs / "single")
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=2**-7, atol=1e-6, msg=name)


def _resume(cfg: Path) -> None:
    resumed = yaml.safe_load(cfg.read_text())
    resumed["training"]["resume"] = "latest"
    cfg.write_text(yaml.safe_dump(resumed))
    spawn(_train, 2, cfg, timeout_s=TIMEOUT_S)


def test_a_killed_float8_fsdp2_run_resumes_to_the_uninterrupted_losses_and_weights(runs, tmp_path):
    cfg = _config(runs, "killed", "fsdp", 1)
    done = _kill_after_checkpoint(cfg, SAVE_STEPS)
    _resume(cfg)
    want, got = train_losses(runs / "fsdp"), train_losses(runs / "killed")
    after = list(range(done + 1, STEPS + 1))
    assert after, "the kill came after the last step"
    assert [got[s] for s in after] == [want[s] for s in after]  # the same ranks, the same sums: bitwise
    final, straight = _final_weights(runs / "killed"), _final_weights(runs / "fsdp")
    for name in straight:
        assert torch.equal(final[name], straight[name]), name


#: Reads a DCP checkpoint and a safetensors file where torchao cannot be imported.
_WITHOUT_TORCHAO = """
import json
import sys
sys.modules["torchao"] = None  # any import of torchao now fails
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp, final, out = sys.argv[1:]
meta = FileSystemReader(dcp).read_metadata()
dtypes = {str(m.properties.dtype) for m in meta.state_dict_metadata.values() if hasattr(m, "properties")}
dcp_to_torch_save(dcp, out)
state = torch.load(out, weights_only=True)
weights = {k: v for k, v in state["model"].items()}
assert weights and all(type(v) is torch.Tensor for v in weights.values()), {k: type(v) for k, v in weights.items()}
loaded = sorted({str(v.dtype) for v in weights.values()})
print(json.dumps({"dcp": sorted(dtypes), "loaded": loaded, "final": sorted({str(v.dtype) for v in load_file(final).values()})}))
"""


def test_the_checkpoint_and_the_final_model_hold_plain_tensors_loadable_without_torchao(runs, tmp_path):
    run = runs / "fsdp"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _WITHOUT_TORCHAO,
            str(run / "checkpoints" / f"step-{STEPS}" / "dcp"),  # the newest: the older ones were rotated away
            str(run / "final" / "model.safetensors"),
            str(tmp_path / "state.pt"),
        ],
        env=child_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    dtypes = json.loads(proc.stdout.strip().splitlines()[-1])
    # the weights bfloat16 (model.dtype), AdamW's moments and step float32: no float8 anywhere
    assert dtypes == {"dcp": ["torch.bfloat16", "torch.float32"], "loaded": ["torch.bfloat16"], "final": ["torch.bfloat16"]}


def test_a_killed_float8_run_beside_expert_parallelism_resumes_to_the_uninterrupted_losses(tmp_path):
    """Expert parallelism with FSDP2 and a float8 full fine-tune (tiny qwen3-moe): the experts are
    no linears and stay bf16, each rank's block checkpointed beside the float8 layers' plain shards."""
    straight = _config(tmp_path, "ep", "fsdp", 1, preset="tiny-qwen3-moe", expert_parallel=2, max_steps=6)
    spawn(_train, 2, straight, timeout_s=TIMEOUT_S)
    applied = json.loads((tmp_path / "ep" / "optimizations.json").read_text())["applied"]
    assert {"fp8", "expert_parallel", "fsdp"} <= {t["name"] for t in applied}
    cfg = _config(tmp_path, "ep-killed", "fsdp", 1, preset="tiny-qwen3-moe", expert_parallel=2, max_steps=6)
    done = _kill_after_checkpoint(cfg, SAVE_STEPS)
    _resume(cfg)
    want, got = train_losses(tmp_path / "ep"), train_losses(tmp_path / "ep-killed")
    after = list(range(done + 1, 7))
    assert after, "the kill came after the last step"
    assert [got[s] for s in after] == [want[s] for s in after]
