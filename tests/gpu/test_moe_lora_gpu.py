"""The grouped MoE experts kernels on CUDA at real shapes, against the float32 per-expert
reference: output and every gradient, in bf16 (relative error in norm within 1.5x that of the
same per-expert loop run in plain bf16 PyTorch, plus 2e-3, and <= 3e-2) and in fp32
(<= 1e-4: IEEE float32 dots, no TF32), both layouts, and under Inductor with
``torch.compile(fullgraph=True)``. Skipped without a GPU.

The kernels launch with one tile per problem chosen from its shape (no autotuning: each kernel
variant compiles once), float32 included, which keeps this file to well under two minutes;
``HONE_MOE_AUTOTUNE=1`` (autotuning over every fitting config) is checked at a small shape.

Shapes: one layer of qwen3-30b-a3b (hidden 2048, expert intermediate 768, 128 experts, top-8,
4096 tokens: seq 2048 x 2) and of gpt-oss-20b (hidden 2880, intermediate 2880, 32 experts,
top-4, 2048 tokens), LoRA r16; routing skewed so some experts get many rows and some none."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from moe_lora_checks import FULL, LORA, check_readers, make_case, run  # noqa: E402

from hone.kernels.moe_lora import moe_experts, moe_triton_available  # noqa: E402
from hone.kernels.moe_lora_reference import GPT_OSS, QWEN3_MOE, moe_experts_reference  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = {
    # name: (layout, tokens, hidden, inter, experts, k, rank, empty, weight std, bias)
    "qwen3-30b-a3b": (QWEN3_MOE, 4096, 2048, 768, 128, 8, 16, 3, 0.02, False),
    "gpt-oss-20b": (GPT_OSS, 2048, 2880, 2880, 32, 4, 16, 2, 0.02, True),
}


def _case(name: str, seed: int = 0) -> dict:
    layout, tokens, hidden, inter, experts, k, rank, empty, std, bias = SHAPES[name]
    case = make_case(layout, tokens, hidden, inter, experts, k, rank, empty, seed, std, bias, device="cuda", skew=0.97)
    # LoRA B is zero at init in real runs; a trained adapter's update is small beside W.
    for key in ("gu_B", "dn_B"):
        case["tensors"][key] = case["tensors"][key] * 0.05
    return case


def _rel_norm(got: dict, expected: dict) -> dict:
    return {
        name: ((got[name] - ref).norm() / ref.norm()).item() if got.get(name) is not None else float("inf")
        for name, ref in expected.items()
    }


def _reference(case: dict, trainable: set[str], dtype: torch.dtype, compute_dtype=torch.float32) -> dict:
    """The reference fed the same (dtype-rounded) inputs the kernel sees, computing in ``compute_dtype``."""
    rounded = dict(case, tensors={n: (t.to(dtype).float() if t is not None else None) for n, t in case["tensors"].items()})

    def reference(*args):
        return moe_experts_reference(*args, compute_dtype=compute_dtype)

    return run(reference, rounded, trainable)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("trainable_name", ["lora", "full"])
def test_bf16_matches_float32_reference(name, trainable_name):
    assert moe_triton_available("cuda")
    case = _case(name)
    trainable = LORA if trainable_name == "lora" else FULL
    trainable = {n for n in trainable if case["tensors"].get(n) is not None}
    expected = _reference(case, trainable, torch.bfloat16)
    plain_bf16 = _rel_norm(_reference(case, trainable, torch.bfloat16, compute_dtype=torch.bfloat16), expected)
    got = run(moe_experts, case, trainable, dtype=torch.bfloat16)
    errors = _rel_norm(got, expected)
    for value in got.values():
        assert torch.isfinite(value).all()
    too_far = {n: (e, plain_bf16[n]) for n, e in errors.items() if e > 1.5 * plain_bf16[n] + 2e-3 or e > 3e-2}
    assert not too_far, f"(kernel, plain bf16) relative errors: {too_far}"


@pytest.mark.parametrize("name", list(SHAPES))
def test_fp32_matches_float32_reference(name):
    case = _case(name, seed=1)
    trainable = {n for n in LORA | FULL if case["tensors"].get(n) is not None}
    expected = run(moe_experts_reference, case, trainable)
    got = run(moe_experts, case, trainable)
    errors = _rel_norm(got, expected)
    assert all(err <= 1e-4 for err in errors.values()), errors


def test_inductor_fullgraph_equals_eager():
    case = _case("qwen3-30b-a3b", seed=2)
    trainable = {n for n in LORA if case["tensors"].get(n) is not None}
    eager = run(moe_experts, case, trainable, dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = run(torch.compile(moe_experts, fullgraph=True), case, trainable, dtype=torch.bfloat16)
    errors = _rel_norm(compiled, eager)
    # Inductor may fuse the activation and the combine differently: bf16 rounding, not exactness.
    assert all(err <= 1e-2 for err in errors.values()), errors


def test_empty_experts_get_zero_weight_gradient():
    case = _case("qwen3-30b-a3b", seed=3)
    got = run(moe_experts, case, {"gate_up", "down", "gu_A", "gu_B"}, dtype=torch.bfloat16)
    empty = slice(128 - 3, 128)  # the last experts are never routed (make_case's ``empty``)
    for name in ("gate_up", "down", "gu_A", "gu_B"):
        assert got[name][empty].abs().max().item() == 0.0
        assert got[name][: 128 - 3].abs().max().item() > 0.0


def test_autotuning_when_asked_for_times_several_tiles_and_matches_the_reference(monkeypatch):
    """HONE_MOE_AUTOTUNE=1 at a shape no other test uses (new autotune keys): several configs
    are timed, and the picked tiles compute what the float32 reference does (bf16 bounds as above)."""
    from hone.kernels.moe_lora_triton import AUTOTUNE_ENV, grouped_mm_kernel

    monkeypatch.setenv(AUTOTUNE_ENV, "1")
    case = make_case(QWEN3_MOE, 384, 256, 128, 8, 2, 16, 1, 5, 0.02, False, device="cuda", skew=0.9)
    trainable = {n for n in LORA if case["tensors"].get(n) is not None}
    expected = _reference(case, trainable, torch.bfloat16)
    plain_bf16 = _rel_norm(_reference(case, trainable, torch.bfloat16, compute_dtype=torch.bfloat16), expected)
    errors = _rel_norm(run(moe_experts, case, trainable, dtype=torch.bfloat16), expected)
    assert len(getattr(grouped_mm_kernel, "configs_timings", None) or {}) > 1
    too_far = {n: (e, plain_bf16[n]) for n, e in errors.items() if e > 1.5 * plain_bf16[n] + 2e-3 or e > 3e-2}
    assert not too_far, f"(kernel, plain bf16) relative errors: {too_far}"


@pytest.mark.parametrize("layout_name", ["qwen3_moe", "gpt_oss"])
def test_the_first_launch_finds_every_kernel_variant_compiled_ahead(layout_name):
    """precompile_projection compiles, in its thread pool, every variant the forward and the
    backward then launch: no Triton compile (or cache load) happens on the launching thread.
    Dimensions not divisible by 16 give specialisations no other test compiled."""
    import threading

    from triton import knobs

    if not hasattr(knobs.compilation, "listener"):
        pytest.skip("this triton has no compilation listener")
    layout = QWEN3_MOE if layout_name == "qwen3_moe" else GPT_OSS
    case = make_case(layout, 200, 200, 72, 6, 2, 16, 1, 7, 0.02, layout is GPT_OSS, device="cuda")
    trainable = {n for n in LORA | FULL if case["tensors"].get(n) is not None}
    threads: list[str] = []
    previous = knobs.compilation.listener
    knobs.compilation.listener = lambda **kw: threads.append(threading.current_thread().name)
    try:
        got = run(moe_experts, case, trainable, dtype=torch.bfloat16)
    finally:
        knobs.compilation.listener = previous
    assert all(torch.isfinite(v).all() for v in got.values())
    assert threads, "nothing was compiled: the test no longer sees fresh specialisations"
    on_launch = [t for t in threads if not t.startswith("hone-moe-compile")]
    assert not on_launch, f"{len(on_launch)} of {len(threads)} compiles happened at launch"


def test_gathered_input_gradient_equals_the_atomic_scatter_at_expert_parallel_shapes():
    """``readers`` (expert parallelism's gather of dX) against the atomic scatter in bf16 at a
    layer of qwen3-30b-a3b over 4 ranks scaled down: 32 local experts, top-8, 1024 received
    rows, 3x as many capacity rows past the real pairs (all naming the padding row)."""
    errors = check_readers(
        n_x=1024, k=8, hidden=2048, out_dim=1536, experts=32, rank=16, spare=3 * 1024 * 8, device="cuda", dtype=torch.bfloat16
    )["errors"]
    bad = {name: err for name, err in errors.items() if isinstance(err, str) or err > 1e-2}
    assert not bad, errors
