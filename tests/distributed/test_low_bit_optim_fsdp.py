"""torchao's 8-bit AdamW under FSDP2 (gloo, CPU): its quantized moments (a tensor subclass inside
DTensors) go through hone's sharded (DCP) checkpoint, and a resume on the same world size is
exact. The run of :mod:`test_fsdp_checkpoint` with ``optimizer.name: adamw_8bit``."""

import pytest
import test_fsdp_checkpoint as base
import torch
from fsdp_harness import spawn

pytest.importorskip("torchao")


def _low_bit_cfg(tmp, adapter, extra):
    cfg = base_cfg(tmp, adapter, extra)
    return cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"name": "adamw_8bit"})})


base_cfg = base._cfg


def _train(rank: int, tmp, run_dir, resume, out) -> None:
    base._cfg = _low_bit_cfg  # this process only (a fresh worker per run)
    base._train(rank, tmp, run_dir, resume, out)


def _run(tmp, run_dir, resume=None):
    out = tmp / f"out-{'resumed' if resume else 'fresh'}.pt"
    spawn(_train, 2, tmp, run_dir, resume, out)
    return torch.load(out)


@pytest.mark.slow
def test_low_bit_adamw_resumes_exactly_from_a_sharded_checkpoint(tmp_path):
    from hone.train.checkpoint import latest_checkpoint
    from hone.train.sharded_checkpoint import is_sharded_checkpoint

    run_dir = tmp_path / "run"
    fresh = _run(tmp_path, run_dir)
    saved = latest_checkpoint(run_dir)
    assert is_sharded_checkpoint(saved)
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(saved / "dcp")).read_metadata().state_dict_metadata
    moments = {k: v for k, v in metadata.items() if k.endswith("mlp.gate_proj.weight.exp_avg")}
    # DCP stores each moment as the float32 tensor it stands for (dequantized, full shape); a load
    # quantizes it back into the subclass, to the same codes and scales (the resume below is exact)
    assert moments and all(m.properties.dtype == torch.float32 and tuple(m.size) == (192, 64) for m in moments.values())
    resumed = _run(tmp_path, run_dir, resume=run_dir)
    assert resumed["losses"] == fresh["losses"][base.SAVE_AT :]
    for name, value in fresh["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name


def _run_on(tmp, world: int, run_dir, resume=None):
    out = tmp / f"out-{world}-{'resumed' if resume else 'fresh'}.pt"
    spawn(_train, world, tmp, run_dir, resume, out)
    return torch.load(out)


@pytest.mark.long  # ~30 s on 2 cores (a one-process run, then two ranks); the resume beside it runs in CI
def test_a_one_process_low_bit_checkpoint_is_refused_on_two_fsdp_ranks(tmp_path):
    """Its quantized moments cannot be split into shards; loading them dequantized would train on
    with full-precision moments, unasked: the resume is refused, saying what works."""
    _run_on(tmp_path, 1, tmp_path / "run1")
    with pytest.raises(Exception, match="quantized .*OptimState8bit.*resume it on one process"):
        _run_on(tmp_path, 2, tmp_path / "run1", resume=tmp_path / "run1")
