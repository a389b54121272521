"""``performance``: torch_compile keys, the Inductor allowlist and the rules that refuse
impossible combinations at validation time (before any model is loaded)."""

import pytest

from hone.config import ConfigError, parse_config
from hone.config.performance import COMPILE_MODES, INDUCTOR_OPTIONS, PerformanceConfig

MINIMAL = {
    "model": {"preset": "tiny-llama"},
    "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca"}]},
}


def issues(performance=None, **sections):
    raw = {**MINIMAL, **sections}
    if performance is not None:
        raw["performance"] = performance
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    return {i.path: i.message for i in info.value.issues}


def test_defaults_compile_regionally_on_cuda_only_and_leave_cuda_graphs_to_the_plan():
    perf = parse_config(MINIMAL).performance
    assert perf.torch_compile == "auto" and perf.torch_compile_scope == "regional"
    assert perf.torch_compile_options == {} and not perf.uses_cudagraphs
    assert perf.cuda_graphs == "auto" and perf.cudagraphs_setting is None
    assert perf.compiles_on("cuda") and not perf.compiles_on("cpu")


def test_auto_compiles_on_cuda_only():
    perf = PerformanceConfig(torch_compile="auto")
    assert perf.compiles_on("cuda") and not perf.compiles_on("cpu") and perf.may_compile


def test_allowlisted_options_including_dotted_keys_are_accepted():
    options = {"coordinate_descent_tuning": True, "triton.cudagraphs": False, "shape_padding": False}
    perf = parse_config({**MINIMAL, "performance": {"torch_compile": True, "torch_compile_options": options}}).performance
    assert perf.torch_compile_options == options


def test_unknown_option_is_refused_with_the_allowed_keys():
    found = issues({"torch_compile": True, "torch_compile_options": {"max_autotune": True, "triton.cudagraph": True}})
    message = found["performance.torch_compile_options"]
    assert "'max_autotune' is not an allowed Inductor option" in message
    assert "'triton.cudagraph' is not an allowed" in message
    assert "Allowed keys: " + ", ".join(INDUCTOR_OPTIONS) in message


def test_nested_options_are_pointed_to_their_dotted_key():
    found = issues({"torch_compile": True, "torch_compile_options": {"triton": {"cudagraphs": True}}})
    assert "a nested option is one dotted key, e.g. 'triton.cudagraphs'" in found["performance.torch_compile_options"]


@pytest.mark.parametrize("value", [1, "true", 0.5, None])
def test_option_values_must_have_the_keys_type(value):
    found = issues({"torch_compile": True, "torch_compile_options": {"epilogue_fusion": value}})
    message = found["performance.torch_compile_options"]
    assert "'epilogue_fusion' must be true or false" in message and repr(value) in message


@pytest.mark.parametrize(
    "stray",
    [
        {"torch_compile_options": {"coordinate_descent_tuning": True}},
        {"torch_compile_mode": "max-autotune"},
        {"torch_compile_scope": "model"},
    ],
)
def test_compile_keys_without_compilation_are_refused(stray):
    found = issues({"torch_compile": False, **stray})
    (message,) = found.values()
    assert next(iter(stray)) in message and "torch_compile is false" in message and "true (or auto)" in message


def test_a_resolved_config_with_compile_off_loads_back():
    from hone.config.loader import dump_config

    cfg = parse_config(MINIMAL)
    assert parse_config(__import__("yaml").safe_load(dump_config(cfg))) == cfg


def test_options_with_auto_pass_validation():
    perf = parse_config(
        {**MINIMAL, "performance": {"torch_compile": "auto", "torch_compile_options": {"fx_graph_cache": False}}}
    ).performance
    assert perf.torch_compile_options == {"fx_graph_cache": False}


def test_inductor_settings_need_the_inductor_backend():
    found = issues({"torch_compile": True, "torch_compile_backend": "aot_eager", "torch_compile_mode": "max-autotune"})
    (message,) = found.values()
    assert "torch_compile_mode" in message and "'aot_eager'" in message and "inductor" in message


@pytest.mark.parametrize(
    ("perf", "cudagraphs"),
    [
        ({"torch_compile_mode": "reduce-overhead"}, True),
        ({"torch_compile_mode": "max-autotune"}, True),
        ({"torch_compile_mode": "max-autotune-no-cudagraphs"}, False),
        ({"torch_compile_mode": "max-autotune", "torch_compile_options": {"triton.cudagraphs": False}}, False),
        ({"torch_compile_options": {"triton.cudagraphs": True}}, True),
    ],
)
def test_cudagraphs_follow_the_mode_unless_the_option_says_otherwise(perf, cudagraphs):
    assert PerformanceConfig(torch_compile=True, **perf).uses_cudagraphs is cudagraphs


def test_mode_table_matches_the_installed_torch():
    from torch._inductor import list_mode_options

    for mode, cudagraphs in COMPILE_MODES.items():
        assert bool(list_mode_options(mode).get("triton.cudagraphs", False)) is cudagraphs, mode


@pytest.mark.parametrize(
    "perf",
    [{"torch_compile_options": {"triton.cudagraphs": True}}, {"torch_compile_mode": "reduce-overhead"}],
)
@pytest.mark.parametrize("attn", ["sdpa", "flex_attention", "flash_attention_2"])
def test_cudagraphs_with_packing_are_taken_with_every_backend(perf, attn, monkeypatch):
    """Packed boundaries take one count under CUDA graphs (hone.train.batches.PackedBatches); every
    backend gets them as varlen arguments (flash attention: all four, so transformers never checks
    the positions on the host) or as hone's mask."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real(name, *a))
    data = {**MINIMAL["data"], "sample_packing": True}
    model = {"preset": "tiny-llama", "dtype": "bfloat16", "attn_implementation": attn}
    cfg = parse_config({"model": model, "data": data, "performance": {"torch_compile": True, **perf}})
    assert cfg.performance.uses_cudagraphs and cfg.data.sample_packing


def test_flat_axolotl_key_points_to_the_performance_section():
    found = issues(None, torch_compile=True)
    assert "did you mean 'performance.torch_compile'" in found["torch_compile"]


def test_the_comm_overlap_switch_brings_the_passes_that_make_it_reorder():
    """torch's default pass list for ``reorder_for_compute_comm_overlap`` is empty (the switch
    alone moves nothing): hone hands Inductor the recommended passes with it, and only with it."""
    import torch._inductor.config as inductor_config

    from hone.transforms.inductor import COMM_OVERLAP_PASSES, compile_options

    on = PerformanceConfig(torch_compile=True, torch_compile_options={"reorder_for_compute_comm_overlap": True})
    assert compile_options(on)["reorder_for_compute_comm_overlap_passes"] == list(COMM_OVERLAP_PASSES)
    off = PerformanceConfig(torch_compile=True, torch_compile_options={"reorder_for_compute_comm_overlap": False})
    assert "reorder_for_compute_comm_overlap_passes" not in compile_options(off)
    assert compile_options(PerformanceConfig(torch_compile=True)) is None
    # torch still knows every pass by its name (a renamed pass would fail at compile time, not here)
    from torch._inductor import comms

    assert all(callable(getattr(comms, name, None)) for name in set(COMM_OVERLAP_PASSES)), dir(comms)
    with inductor_config.patch(reorder_for_compute_comm_overlap_passes=["sink_waits_iterative"]):
        assert "reorder_for_compute_comm_overlap_passes" not in compile_options(on)  # a list already set is kept
