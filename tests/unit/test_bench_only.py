"""``hone bench SPEC --only ...``: a benchmark file can name the committed spec and the rows it
ran, instead of a cut-down copy of the spec that nobody else has."""

from pathlib import Path

import pytest

from hone.bench.spec import load_spec
from hone.cli import main
from hone.config import ConfigError

DPO = Path(__file__).resolve().parents[2] / "benchmarks" / "specs" / "qwen3-8b-dpo.yml"


def test_only_keeps_the_named_or_numbered_conditions_in_the_specs_order():
    whole = load_spec(DPO)
    names = [c.name for c in whole.conditions]
    picked = load_spec(DPO, only=[names[4], "3", " 1 "])
    assert [c.name for c in picked.conditions] == [names[0], names[2], names[4]]
    assert picked.workload == whole.workload and picked.timed_steps == whole.timed_steps
    assert load_spec(DPO, only=["2", names[1]]).conditions == [whole.conditions[1]]  # named twice, run once


@pytest.mark.parametrize("item", ["0", str(10**3), "hone, defaults", "TRL"])
def test_an_unknown_condition_is_an_error_that_lists_the_specs_conditions(item):
    with pytest.raises(ConfigError) as info:
        load_spec(DPO, only=["1", item])
    text = str(info.value)
    assert f"--only {item!r} is neither a condition's name nor its number" in text
    assert "1: TRL, no checkpointing; 2: TRL, checkpointing" in text


def test_only_needs_a_spec_file(capsys):
    assert main(["bench", "--preset", "tiny-llama", "--only", "1"]) != 0
    assert "--only picks conditions of a spec file" in capsys.readouterr().err


def test_a_spec_with_a_row_its_run_would_refuse_runs_nothing(tmp_path, capsys):
    """Every hone row is planned before the first runs (as `hone plan SPEC` plans it): a refused
    row would otherwise fail at its start after the rows before it had spent the GPU's time."""
    spec = tmp_path / "spec.yml"
    spec.write_text(
        "name: refused\n"
        "workload: {preset: tiny-llama, sequence_len: 64, dtype: float32}\n"
        "conditions:\n"
        "  - name: runs\n"
        "  - name: graphs beside FSDP2\n"
        "    nproc: 2\n"
        "    set: {distributed.strategy: fsdp, performance.torch_compile: true, performance.cuda_graphs: true}\n"
    )
    out = tmp_path / "out"
    assert main(["bench", str(spec), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "1 condition(s) of the spec would be refused (nothing was run" in err
    assert f"{spec} [graphs beside FSDP2]: cannot apply the optimizations" in err
    assert "uses CUDA graphs, which cannot replay beside distributed.strategy: fsdp" in err  # on any machine
    assert not (out / "results.jsonl").exists()  # not even the first row ran
