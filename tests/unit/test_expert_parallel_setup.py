"""``distributed.expert_parallel`` before any process group: the config's refusals, the launch
check, the plan's checks and order, the experts backend it picks, and the layout contract of a
rank's block (its experts' tensors and PEFT's LoRA factors for them) against the whole model.
Training on 2 gloo ranks is tested in tests/distributed/test_expert_parallel_training.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hone.config import parse_config
from hone.config.adapter import AdapterConfig
from hone.errors import HoneError
from hone.models.adapters import apply_adapter
from hone.models.experts.backend import EXPERT_SHARD_ATTR, experts_modules, register_hone_experts
from hone.models.experts.lora import expert_lora_factors
from hone.models.experts.parallel import expert_parallel_names, join_blocks, local_block, shard_experts, take_overflow
from hone.models.presets import build_preset_config
from hone.parallel.expert_parallel import ExpertShard
from hone.runtime.world import World
from hone.train.distributed import check_launch
from hone.train.grad_norm import global_grad_norm
from hone.transforms.base import RunFacts
from hone.transforms.planner import plan_optimizations

CPU = torch.device("cpu")
MOE = {"preset": "tiny-qwen3-moe", "dtype": "float32"}
DATA = {"datasets": [{"path": "d.jsonl", "type": "alpaca"}]}
LORA = AdapterConfig(type="lora", lora_r=2, lora_target_modules=["q_proj", "experts"])


def config(model=None, adapter="none", **distributed):
    return parse_config({"model": model or MOE, "data": DATA, "adapter": adapter, "distributed": distributed})


@pytest.mark.parametrize(
    ("model", "distributed", "message"),
    [
        (MOE, {"expert_parallel": 0}, "distributed.expert_parallel: 0 must be at least 1"),
        (MOE, {"expert_parallel": 2, "strategy": "none"}, "runs on several processes, which distributed.strategy: none refuses"),
        (MOE, {"expert_parallel": 2, "expert_capacity_factor": 0}, "expert_capacity_factor: 0.0 must be a positive"),
        (MOE, {"expert_capacity_factor": 1.25}, "sizes the exchanges of expert parallelism, which is off"),
        (MOE, {"expert_parallel_recompute": True}, "expert_parallel_recompute: true recomputes the local experts"),
        ({**MOE, "experts_implementation": "grouped_mm"}, {"expert_parallel": 2}, "model.experts_implementation is 'grouped_mm'"),
    ],
)
def test_the_config_refuses_what_expert_parallelism_cannot_run(model, distributed, message):
    with pytest.raises(HoneError, match=message):
        config(model, **distributed)


def test_mxfp4_experts_validate_and_plan_per_rank():
    """``model.quantize: mxfp4`` with expert parallelism: the config validates, the plan quantizes,
    picks hone's experts forward and then splits; each rank's estimate holds half the experts."""
    from hone.transforms.plan_report import plan_view

    cfg = config({"preset": "tiny-gpt-oss", "quantize": "mxfp4", "dtype": "float32"}, "lora", expert_parallel=2)
    plan = plan_optimizations(cfg, RunFacts(CPU, world=World(0, 2, 0)))
    names = plan.names
    assert names.index("quantize") < names.index("experts") < names.index("expert_parallel") < names.index("ddp")
    assert plan.decided.experts_implementation == "hone"
    one = config({"preset": "tiny-gpt-oss", "quantize": "mxfp4", "dtype": "float32"}, "lora")
    split = plan_view(cfg, "t", "cuda", 80 * 2**30, "test", 2**40).estimates["none"]
    whole = plan_view(one, "t", "cuda", 80 * 2**30, "test", 2**40).estimates["none"]
    assert split.weights < whole.weights


def test_a_big_preset_drawn_on_the_device_quantizes_then_keeps_each_rank_s_mxfp4_block():
    """``model.quantize: mxfp4`` beside expert parallelism on a big preset: each experts module is
    quantized as drawn, then keeps its rank's block of the blocks and scales, its placeholders cut
    to the block's shape (never materialized)."""
    from hone.models.experts.mxfp4 import is_placeholder, mxfp4_weights, quantize_experts
    from hone.models.materialize import build_skeleton, materialize

    cfg = config({**MOE, "quantize": "mxfp4"}, "lora", expert_parallel=2)
    facts = RunFacts(CPU, world=World(1, 2, 1))
    plan = plan_optimizations(cfg, facts)
    moe = build_preset_config("tiny-qwen3-moe", {}, 64)
    torch.manual_seed(5)
    whole = materialize(build_skeleton(moe, torch.float32), CPU)
    skeleton = build_skeleton(moe, torch.float32)
    torch.manual_seed(5)
    drawn = materialize(skeleton, CPU, plan.as_drawn(cfg, facts)(skeleton))
    for (name, module), (_, full) in zip(experts_modules(drawn), experts_modules(whole), strict=True):
        quantize_experts(full, CPU)
        assert getattr(module, EXPERT_SHARD_ATTR).rank == 1 and module.down_proj.shape[0] == 4, name
        assert is_placeholder(module.gate_up_proj) and is_placeholder(module.down_proj)
        for projection, (blocks, scales) in mxfp4_weights(module).items():
            want_blocks, want_scales = mxfp4_weights(full)[projection]
            assert torch.equal(blocks, want_blocks[4:]) and torch.equal(scales, want_scales[4:]), (name, projection)
            assert blocks.is_contiguous() and blocks.untyped_storage().nbytes() == blocks.numel()  # the block alone
    lora = apply_adapter(drawn, LORA)
    expert_a = [p for n, p in lora.named_parameters() if "experts" in n and "lora_A" in n]
    assert expert_a and all(p.shape[0] == LORA.lora_r * 4 for p in expert_a)  # PEFT sizes the factors for 4 experts


def test_expert_parallel_must_divide_the_processes():
    check_launch(config(expert_parallel=2), World(0, 4, 0), "cpu", local_processes=4)  # 2 groups of 2, 2 replicas
    with pytest.raises(HoneError, match="distributed.expert_parallel: 4 on 6 processes: N must divide .* 2, 3, 6"):
        check_launch(config(expert_parallel=4), World(0, 6, 0), "cpu", local_processes=6)
    with pytest.raises(HoneError, match="distributed.expert_parallel: 2 on 1 process: .*divisors over 1: none"):
        check_launch(config(expert_parallel=2), World(), "cpu")
    check_launch(config(expert_parallel=2), World(1, 2, 1), "cpu", local_processes=2)


def test_expert_parallel_below_the_world_size_runs_beside_ddp_and_fsdp2():
    from hone.transforms.planner import decisions

    for strategy in ("ddp", "fsdp"):
        cfg, facts = config(expert_parallel=2, strategy=strategy), RunFacts(CPU, world=World(0, 4, 0))
        plan = plan_optimizations(cfg, facts)
        assert plan.decided.strategy == strategy and "expert_parallel" in plan.names
        why = {name: why for name, _, _, why in decisions(cfg, facts, decided=plan.decided)}["expert_parallel"]
        assert why.endswith("; 2 replicas of each block (groups of 2 consecutive ranks) sum its gradients once per step")


def test_the_plan_shards_experts_after_the_backend_with_hone_s_forward_even_on_the_cpu():
    plan = plan_optimizations(config(expert_parallel=2), RunFacts(CPU, world=World(0, 2, 0)))
    names = plan.names
    assert names.index("experts") < names.index("expert_parallel") < names.index("ddp")
    assert plan.decided.experts_implementation == "hone"
    assert plan.decided.strategy == "ddp" and "experts split over 2 ranks" in plan.decided.strategy_why
    assert "expert_parallel" not in plan_optimizations(config(), RunFacts(CPU, world=World(0, 2, 0))).names


@pytest.mark.parametrize(
    ("model", "ranks", "message"),
    [
        ({"preset": "tiny-llama"}, 2, "splits the experts of mixture-of-experts layers, and .* has none"),
        (MOE, 3, "has 8 experts per layer, which 3 ranks cannot split evenly"),
    ],
)
def test_the_plan_refuses_a_model_it_cannot_split(model, ranks, message):
    with pytest.raises(HoneError, match=message):
        plan_optimizations(config(model, expert_parallel=ranks), RunFacts(CPU, world=World(0, ranks, 0)))


def test_the_plan_refuses_tiled_layers_and_mlp_beside_expert_parallelism():
    cfg = parse_config({"model": MOE, "data": DATA, "memory": {"tiled_mlp": 2}, "distributed": {"expert_parallel": 2}})
    with pytest.raises(HoneError, match="does not run with memory.tiled_mlp yet"):
        plan_optimizations(cfg, RunFacts(CPU, world=World(0, 2, 0)))


def _moe(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(build_preset_config("tiny-qwen3-moe", {}, 64), dtype=torch.float32)


def test_a_rank_s_block_is_its_experts_and_the_lora_factors_peft_makes_for_them():
    whole = apply_adapter(_moe(), LORA)
    with torch.no_grad():
        for param in whole.parameters():
            param.copy_(torch.randn_like(param))
    blocks = []
    for rank in (0, 1):
        model = _moe()
        model.config._experts_implementation = "hone"  # what the experts transform selects
        assert shard_experts(model, 2, rank, max_tokens=16) == 2
        model = apply_adapter(model, LORA)
        names = expert_parallel_names(model)
        assert any(".lora_B." in n for n in names) and any(n.endswith(".down_proj") for n in names)
        assert not any("q_proj" in n for n in names)
        full = dict(whole.named_parameters())
        with torch.no_grad():
            for name, param in model.named_parameters():
                shard = getattr(experts_modules(model)[0][1], EXPERT_SHARD_ATTR)
                param.copy_(local_block(name, full[name], shard) if name in names else full[name])
        # PEFT's per-expert view of the rank's factors is the whole model's, experts [4 rank, 4 rank + 4)
        for (name, wrapper), (_, local) in zip(_wrappers(whole), _wrappers(model), strict=True):
            for got, want in zip(expert_lora_factors(local, "default"), expert_lora_factors(wrapper, "default"), strict=True):
                torch.testing.assert_close(got, want[4 * rank : 4 * rank + 4], rtol=0, atol=0, msg=name)
        blocks.append({n: p.detach() for n, p in model.named_parameters() if n in names})
    for name, block in blocks[0].items():
        joined = join_blocks(name, [block, blocks[1][name]], local_count=4)
        torch.testing.assert_close(joined, dict(whole.named_parameters())[name].detach(), rtol=0, atol=0, msg=name)


def _wrappers(model):
    from peft.tuners.lora.layer import ParamWrapper

    return [(n, m) for n, m in model.named_modules() if isinstance(m, ParamWrapper)]


def test_the_norm_of_sharded_gradients_alone_on_one_process_is_their_plain_norm():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    assert global_grad_norm(params, None, sharded=params[1:]).item() == pytest.approx(global_grad_norm(params, None).item())
    assert global_grad_norm(params, 1.0, sharded=params).item() == pytest.approx(2.0 * 7**0.5)
    assert params[0].grad.norm().item() == pytest.approx(2.0 * 3**0.5 / (2.0 * 7**0.5), rel=1e-5)


def test_a_big_preset_drawn_on_the_device_keeps_each_rank_s_block_as_each_experts_module_is_drawn():
    from hone.models.materialize import build_skeleton, materialize

    cfg = config(expert_parallel=2)
    facts = RunFacts(CPU, world=World(1, 2, 1))
    plan = plan_optimizations(cfg, facts)
    moe = build_preset_config("tiny-qwen3-moe", {}, 64)
    torch.manual_seed(5)
    whole = materialize(build_skeleton(moe, torch.float32), CPU)  # the same draws, every expert kept
    skeleton = build_skeleton(moe, torch.float32)
    torch.manual_seed(5)
    drawn = materialize(skeleton, CPU, plan.as_drawn(cfg, facts)(skeleton))
    assert all(m.down_proj.shape[0] == 4 for _, m in experts_modules(drawn))  # split as drawn
    plan.apply(drawn, "base", cfg, facts)  # finds the experts split already: splits nothing twice
    expected = dict(whole.named_parameters())
    for name, param in drawn.named_parameters():
        want = expected[name][4:] if name.endswith("_proj") and ".experts." in name else expected[name]
        torch.testing.assert_close(param, want, rtol=0, atol=0, msg=name)
    assert all(getattr(m, EXPERT_SHARD_ATTR).rank == 1 for _, m in experts_modules(drawn))


def test_expert_parallel_lora_starts_from_the_draws_of_one_process():
    whole = _moe()
    whole.config._experts_implementation = "hone"
    torch.manual_seed(7)
    expected = dict(apply_adapter(whole, LORA).named_parameters())
    for rank in (0, 1):
        model = _moe()
        model.config._experts_implementation = "hone"
        shard = ExpertShard(2, rank, 8)
        shard_experts(model, 2, rank)
        torch.manual_seed(7)
        model = apply_adapter(model, LORA)
        names = set(expert_parallel_names(model))
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        assert {n for n, _ in trained} == {n for n, p in expected.items() if p.requires_grad}
        for name, param in trained:  # attention LoRA after the experts' too: the generator stays in step
            want = local_block(name, expected[name].detach(), shard) if name in names else expected[name]
            torch.testing.assert_close(param, want, rtol=0, atol=0, msg=name)
        assert any(n in names and "lora_A" in n and p.abs().sum() > 0 for n, p in trained)


def test_the_overflow_taken_is_one_layer_s_largest_and_a_forward_run_again_does_not_add_to_it():
    """The counter keeps the most pairs one forward of a layer left out, so a forward re-run in the
    backward (full checkpointing) does not count them twice and the error can say how much
    capacity that layer needed; taking it clears it."""
    register_hone_experts()
    model = _moe()
    model.config._experts_implementation = "hone"
    shard_experts(model, 1, 0, max_tokens=16, capacity=8)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    per_layer = []
    with torch.no_grad():
        model(ids)
        for _, module in experts_modules(model):
            per_layer.append(int(module.hone_expert_overflow))
        once = take_overflow(model)
        model(ids)
        model(ids)  # the same micro-batch's forward again, as checkpointing re-runs it
        again = take_overflow(model)
    assert min(per_layer) > 0 and int(once) == max(per_layer) == int(again), (per_layer, once, again)
    assert int(take_overflow(model)) == 0
