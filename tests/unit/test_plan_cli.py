"""``hone plan``: every example config and bench spec plans offline without weights; sizes and
errors of ``--gpu-memory``; the report's extension point for the planner's transform list."""

from pathlib import Path

import pytest

from hone.cli import build_parser, main
from hone.errors import HoneError
from hone.transforms.plan_report import DEFAULT_GPU_MEMORY, device_memory, parse_size, plan_view, render_plan
from hone.units import GIB

ROOT = Path(__file__).resolve().parents[2]


EXAMPLES = sorted((ROOT / "examples").glob("*.yml"))
SPECS = sorted((ROOT / "benchmarks" / "specs").glob("*.yml"))


@pytest.fixture(autouse=True)
def _from_repo_root(monkeypatch, hub_standins):
    monkeypatch.chdir(ROOT)  # the examples name their data relative to the repository
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # model ids: the stand-in cache (tests/conftest.py)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_plan_every_example(path, capsys):
    assert main(["plan", str(path.relative_to(ROOT)), "--gpu-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "peak (GPU)" in out and "fits 24.0 GiB" in out and "longest sequence that fits" in out
    for policy in ("none", "selective", "full", "offload"):
        assert policy in out
    lines = out.splitlines()
    assert lines[0].startswith(("fits: ", "does not fit: ")) and " of 24.0 GiB (" in lines[0] and "on cuda" in lines[0]
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    header = next(line for line in lines if line.lstrip().startswith("component "))
    assert header.count(" *") == 1  # the policy the run uses, `auto` or not


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_plan_every_bench_spec(path, capsys):
    assert main(["plan", str(path.relative_to(ROOT)), "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert out.count("hone plan: ") >= 1
    assert "[reference" not in out  # reference rows are not hone runs


def test_plan_reads_no_weights(tmp_path, capsys):
    """A model directory with only config.json (and a tokenizer) plans like a full one."""
    from hone.models.presets import build_preset_config

    model_dir = tmp_path / "model"
    build_preset_config("llama3-8b", {"num_hidden_layers": 4}, None).save_pretrained(model_dir)
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(
        f"model: {{path: {model_dir}}}\n"
        "data: {datasets: [{path: missing.jsonl, type: completion}], sequence_len: 4096}\n"
        "memory: {gradient_checkpointing: true}\n"
    )
    assert main(["plan", str(cfg), "--gpu-memory", "80GB", "--set", "training.micro_batch_size=2"]) == 0
    captured = capsys.readouterr()
    assert "micro-batch 2 x 4096 tokens" in captured.out
    assert "full *" in captured.out
    assert "not needed for the plan" in captured.err  # the data file is missing: a note only


def test_plan_needs_the_model_directory(tmp_path, capsys):
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(f"model: {{path: {tmp_path / 'nope'}}}\ndata: {{datasets: [{{path: x.jsonl, type: completion}}]}}\n")
    assert main(["plan", str(cfg)]) == 2
    assert "model.path" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * GIB),
        ("24GB", 24 * 10**9),
        ("141 GiB", 141 * GIB),
        ("81559MiB", 81559 * 2**20),
        ("40", 40 * GIB),
        ("0.5TiB", 2**39),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["eighty", "80GiBs", "80 GiB GiB", "-4GiB", "0GiB", ""])
def test_bad_gpu_memory_is_a_clear_error(text, capsys):
    with pytest.raises(HoneError, match="--gpu-memory"):
        parse_size(text)
    assert main(["plan", "examples/quickstart.yml", f"--gpu-memory={text}"]) == 2
    assert "--gpu-memory" in capsys.readouterr().err


def test_device_memory_sources():
    assert device_memory("cuda", "24GiB") == (24 * GIB, "--gpu-memory")
    size, source = device_memory("cuda", None)
    import torch

    if not torch.cuda.is_available():
        assert size == DEFAULT_GPU_MEMORY and "80 GiB" in source
    ram, _ = device_memory("cpu", None)
    assert ram > 0


def test_render_plan_shows_transforms_and_warns_when_the_policy_does_not_fit():
    from hone.config import parse_config

    cfg = parse_config(
        {
            "model": {"preset": "qwen3-8b"},
            "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}], "sequence_len": 8192},
            "memory": {"activation_checkpointing": "none"},
        }
    )
    view = plan_view(cfg, "qwen3-8b", "cuda", 36 * GIB, "--gpu-memory")
    text = render_plan(view, transforms=[("compile", "performance.torch_compile", False, "off in the config")])
    assert "Transforms, in the order" in text and "off in the config" in text
    assert "warning: checkpointing 'none' does not fit" in text
    assert "fits with: selective, full, offload" in text  # compiled by default: selective down to its floor budget
    assert render_plan(view).count("Transforms") == 0


def test_plan_has_help(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["plan", "--help"])
    assert info.value.code == 0
    assert "--gpu-memory" in capsys.readouterr().out


def test_bench_rows_record_the_estimate_and_the_table_shows_it(tmp_path):
    import torch

    from hone.bench.report import markdown_table, summarise
    from hone.bench.spec import load_spec
    from hone.bench.worker import _estimated_peak_gib, _hone_config

    spec = load_spec(ROOT / "benchmarks" / "specs" / "qwen3-8b-lora.yml")
    hone_row = next(c for c in spec.conditions if c.name == "hone, checkpointing")
    cfg = _hone_config(spec, hone_row, tmp_path, tmp_path / "random.jsonl")
    estimated = _estimated_peak_gib(cfg, torch.device("cuda"))
    # the measured H100 peak of full checkpointing with the (default) fused loss: 16.4 GiB (its
    # activations are the layer inputs either way, compiled or not; benchmarks/2026-11-26-h100-seam.md)
    assert estimated == pytest.approx(16.4, rel=0.10)
    rows = [
        {"condition": c.name, "replicate": 0, "status": "ok", "median_ms": 100.0, "min_ms": 99.0, "max_ms": 101.0,
         "first_step_s": 1.0, "tokens_per_s": 1.0, "trained_tokens_per_s": 1.0, "mfu_pct": 1.0, "final_loss": 1.0,
         "peak_alloc_gib": 20.1, "peak_reserved_gib": 21.0, **({"estimated_peak_gib": estimated} if c.reference is None else {})}
        for c in spec.conditions
    ]  # fmt: skip
    table = markdown_table(spec, summarise(spec, rows))
    assert "| peak alloc GiB | estimated GiB |" in table
    assert f"| 20.1 | {estimated:.1f} |" in table


def _plan(args: list[str], capsys) -> list[str]:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out.splitlines()


def test_plan_on_cpu_says_memory_not_gpu_and_names_the_experts(capsys):
    lines = _plan(["examples/moe_expert_lora.yml", "--device", "cpu"], capsys)
    assert lines[0].startswith("fits: ") and " on cpu" in lines[0]
    assert not [line for line in lines if "GPU" in line]
    assert max(len(line) for line in lines) <= 100
    experts = next(line for line in lines if line.split()[:1] == ["experts"] and "(" not in line.split()[1])
    assert experts.split()[1] == "grouped_mm", experts  # transformers' kernel, not "off"


def test_plan_wide_shows_every_reason_and_combination(capsys):
    short = _plan(["examples/compile.yml", "--gpu-memory", "24GiB"], capsys)
    wide = _plan(["examples/compile.yml", "--gpu-memory", "24GiB", "--wide"], capsys)
    assert max(len(line) for line in wide) > 100 and len(wide) > len(short)
    assert any(line.startswith("Longest sequence that fits 24.0 GiB of GPU") for line in wide)
    assert "--wide" in "\n".join(short)


def test_fits_and_longest_share_one_margin():
    """The report never says "fits" beside "longest sequence that fits: none": a peak at 95% of
    the card is over the margin everywhere (verdict, fits row, longest sequence, auto)."""
    from hone.config import parse_config
    from hone.transforms.memory.decide import AUTO_MARGIN

    cfg = parse_config(
        {
            "model": {"preset": "qwen3-8b"},
            "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}], "sequence_len": 4096},
            # one input per layer: auto would take runs of two layers where that is over the margin
            "memory": {"activation_checkpointing": "full", "checkpoint_run_layers": 1},
            "performance": {"torch_compile": False},
        }
    )
    peak = plan_view(cfg, "probe", "cuda", 200 * GIB, "--gpu-memory", 1024 * GIB, "test").estimates["full"].total
    for share, fits in ((0.95, False), (0.85, True)):
        view = plan_view(cfg, "qwen3-8b", "cuda", int(peak / share), "--gpu-memory", 1024 * GIB, "test")
        text = render_plan(view)
        first = text.splitlines()[0]
        assert first.startswith("fits: " if fits else "does not fit: "), first
        row = next(line for line in text.splitlines() if line.lstrip().startswith("fits "))
        assert f"less {AUTO_MARGIN:.0%}" in row
        full_column = list(view.estimates).index("full")
        assert row.split()[-8 + 2 * full_column] == ("yes" if fits else "NO"), row
        longest = view.longest["full"]
        assert (longest >= 4096) == fits, longest
        if fits:
            assert first.endswith(f"longest that fits: {longest:,}")


def test_plan_reads_the_prepared_datas_statistics_where_they_are_cached(tmp_path, capsys):
    """A preference run's rows are as wide as its pairs: once ``hone preprocess`` has cached the
    data, ``hone plan`` decides with its statistics, as the run will (a smaller row, a smaller
    estimate); before, it says it assumes the config's bounds. It never prepares the data itself."""
    cache = ["--set", f"data.dataset_prepared_path={tmp_path / 'cache'}"]
    plan = ["plan", "examples/dpo.yml", "--gpu-memory", "80GiB", *cache]

    def peak(out: str) -> float:
        return float(out.splitlines()[0].split("fits: ")[1].split(" of ")[0])

    assert main(plan) == 0
    bounds = capsys.readouterr()
    assert "the data is not prepared: the plan assumes the config's bounds" in bounds.err
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    assert "micro-batch 8 x 64 tokens" in bounds.out  # 4 pairs, two full sequence_len sequences each
    assert main(["preprocess", "examples/dpo.yml", *cache]) == 0
    capsys.readouterr()
    assert main(plan) == 0
    prepared = capsys.readouterr()
    assert "the plan uses the prepared data's statistics" in prepared.err
    width = int(prepared.out.split("micro-batch 8 x ")[1].split(" tokens")[0])
    assert width < 64 and peak(prepared.out) <= peak(bounds.out)


def test_plan_takes_the_configs_gpu_memory_unless_the_flag_names_another(capsys):
    setting = ["--device", "cuda", "--set", "memory.gpu_memory=24GiB"]
    assert main(["plan", "examples/quickstart.yml", *setting]) == 0
    assert "card: 24.0 GiB (memory.gpu_memory)" in capsys.readouterr().out
    assert main(["plan", "examples/quickstart.yml", *setting, "--gpu-memory", "40GiB"]) == 0
    assert "card: 40.0 GiB (--gpu-memory)" in capsys.readouterr().out


def test_a_refused_config_is_said_in_full_after_the_report_and_exits_2(monkeypatch, capsys):
    """The table's cell is cut at 100 columns; the refusal `hone train` would give is printed whole."""
    monkeypatch.chdir(ROOT)
    args = ["plan", "examples/moe_expert_parallel.yml", "--nproc-per-node", "2", "--gpu-memory", "80GiB"]
    assert main([*args, "--set", "distributed.strategy=fsdp", "--set", "performance.cuda_graphs=true"]) == 2
    captured = capsys.readouterr()
    assert "REFUSED: performance.cuda_graphs: true uses CUDA graphs" in captured.out  # the table's cell
    assert "error: examples/moe_expert_parallel.yml: cannot apply the optimizations" in captured.err
    assert "cannot replay beside distributed.strategy: fsdp" in captured.err
    assert "or, with LoRA, distributed.strategy: ddp, where they replay" in captured.err  # whole, not cut
    assert main([*args, "--set", "distributed.strategy=ddp"]) == 0
    assert "error:" not in capsys.readouterr().err
