"""Loading a gpt-oss checkpoint with MXFP4 experts as it ships (hone/models/mxfp4_checkpoint.py):
the experts stay blocks + scales with placeholder parameters, the model computes what transformers'
GptOss computes with the dequantized experts, the expert LoRA gradients equal those on the
dequantized base, and each bad checkpoint is refused before training, naming file and tensor."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mxfp4_checkpoint import Mxfp4Checkpoint, dequantized_reference, write_mxfp4_gpt_oss  # noqa: E402

from hone.config.adapter import AdapterConfig  # noqa: E402
from hone.config.model import ModelConfig  # noqa: E402
from hone.models.adapters import apply_adapter  # noqa: E402
from hone.models.errors import ModelError  # noqa: E402
from hone.models.experts import set_experts_implementation  # noqa: E402
from hone.models.experts.mxfp4 import is_placeholder, mxfp4_bytes, mxfp4_weights  # noqa: E402
from hone.models.loader import load_pretrained  # noqa: E402

CPU = torch.device("cpu")
LAYER0 = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Mxfp4Checkpoint:
    return write_mxfp4_gpt_oss(tmp_path_factory.mktemp("mxfp4") / "gpt-oss", dtype=torch.float32)


def _load(path: Path) -> torch.nn.Module:
    return load_pretrained(path, ModelConfig(path=path, dtype="float32", attn_implementation="eager"), CPU, torch.float32)


def _copy(checkpoint: Mxfp4Checkpoint, to: Path, edit=None, config_edit=None) -> Path:
    """The checkpoint copied to ``to`` with its tensors (and config.json) edited."""
    to.mkdir()
    tensors = load_file(str(checkpoint.path / "model.safetensors"))
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(to / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((checkpoint.path / "config.json").read_text())
    if config_edit is not None:
        config_edit(config)
    (to / "config.json").write_text(json.dumps(config))
    return to


def test_experts_load_as_blocks_and_scales_and_compute_the_dequantized_model(checkpoint):
    model = _load(checkpoint.path)
    assert getattr(model.config, "quantization_config", None) is None  # transformers ran no quantizer
    experts = [m for m in model.modules() if mxfp4_weights(m)]
    assert len(experts) == checkpoint.config.num_hidden_layers
    for module in experts:
        assert set(mxfp4_weights(module)) == {"gate_up_proj", "down_proj"}
        assert is_placeholder(module.gate_up_proj) and is_placeholder(module.down_proj)  # no float expert weight
        assert module.gate_up_proj.untyped_storage().nbytes() == 4
    files = load_file(str(checkpoint.path / "model.safetensors"))
    blocks, scales = mxfp4_weights(model.get_submodule(LAYER0))["down_proj"]
    assert torch.equal(blocks, files[f"{LAYER0}.down_proj_blocks"]) and torch.equal(scales, files[f"{LAYER0}.down_proj_scales"])
    assert mxfp4_bytes(model) == sum(t.numel() for k, t in files.items() if k.endswith(("_blocks", "_scales")))
    assert all(p.device == CPU and p.dtype == torch.float32 for p in model.parameters())
    assert all(b.device == CPU for b in model.buffers())
    torch.testing.assert_close(model.model.norm.weight, checkpoint.weights["model.norm.weight"], rtol=0, atol=0)

    set_experts_implementation(model, "hone")  # MXFP4 experts: the float32 reference on the CPU
    reference = dequantized_reference(checkpoint)
    ids = torch.randint(0, checkpoint.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_expert_lora_gradients_on_the_mxfp4_base_equal_those_on_the_dequantized_base(checkpoint):
    adapter = AdapterConfig(type="lora", lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj", "experts"])
    base = _load(checkpoint.path)
    set_experts_implementation(base, "hone")
    mxfp4 = apply_adapter(base, adapter)
    gen = torch.Generator().manual_seed(2)
    for name, param in mxfp4.named_parameters():  # a nonzero B, else every A gradient is zero
        if "lora_" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.1
    plain = apply_adapter(dequantized_reference(checkpoint), adapter)
    lora = {k: v for k, v in mxfp4.state_dict().items() if "lora_" in k}
    assert not plain.load_state_dict(lora, strict=False).unexpected_keys
    ids = torch.randint(0, checkpoint.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    grads = []
    for model in (mxfp4, plain):
        model(input_ids=ids).logits.pow(2).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert sorted(grads[0]) == sorted(grads[1]) and sum(".experts." in n for n in grads[0]) == 8
    for name, expected in grads[1].items():
        torch.testing.assert_close(grads[0][name], expected, rtol=1e-5, atol=1e-7, msg=name)


def _drop(key):
    return lambda tensors: tensors.pop(key)


def _truncate(key):
    def edit(tensors):
        tensors[key] = tensors[key][:, :, :1].contiguous()

    return edit


GATE_UP, DOWN = f"{LAYER0}.gate_up_proj", f"{LAYER0}.down_proj"
BAD_CHECKPOINTS = {
    "no-scales": (_drop(f"{GATE_UP}_scales"), [f"'{GATE_UP}_blocks' (in model.safetensors) but not '{GATE_UP}_scales'", "E8M0"]),
    "no-blocks": (_drop(f"{DOWN}_blocks"), [f"'{DOWN}_scales' (in model.safetensors) but not '{DOWN}_blocks'"]),
    "shapes-disagree": (
        _truncate(f"{GATE_UP}_scales"),
        [
            f"'{GATE_UP}_blocks' (model.safetensors)",
            "blocks (8, 64, 2, 16) and scales (8, 64, 1)",
            "expected blocks (8, 64, 2, 16)",
        ],
    ),
    "missing-parameter": (_drop("model.norm.weight"), ["lack 1 tensor(s) the model needs (model.norm.weight)"]),
}


@pytest.mark.parametrize(("edit", "says"), list(BAD_CHECKPOINTS.values()), ids=list(BAD_CHECKPOINTS))
def test_a_bad_mxfp4_checkpoint_is_refused_naming_file_tensor_and_shapes(checkpoint, tmp_path, edit, says):
    bad = _copy(checkpoint, tmp_path / "bad", edit=edit)
    with pytest.raises(ModelError) as err:
        _load(bad)
    for text in says:
        assert text in str(err.value)
    assert str(bad) in str(err.value)


@pytest.mark.parametrize("method", ["fp8", "nvfp4", "bitsandbytes"])
def test_a_checkpoint_quantized_otherwise_is_refused_with_what_hone_loads(checkpoint, tmp_path, method):
    bad = _copy(checkpoint, tmp_path / "other", config_edit=lambda c: c["quantization_config"].update(quant_method=method))
    with pytest.raises(ModelError) as err:
        _load(bad)
    message = str(err.value)
    assert f"quant_method '{method}'" in message and str(bad / "config.json") in message
    assert "quant_method: mxfp4" in message and "model.quantize" in message


def test_hone_validate_refuses_a_checkpoint_quantized_otherwise_before_loading(checkpoint, tmp_path):
    from hone.models.model_dir import model_dir_problems

    bad = _copy(checkpoint, tmp_path / "other", config_edit=lambda c: c["quantization_config"].update(quant_method="fp8"))
    problems, _ = model_dir_problems(bad, trust_remote_code=False)
    assert any("quant_method 'fp8'" in p and "hone does not load" in p for p in problems), problems
    assert model_dir_problems(checkpoint.path, trust_remote_code=False)[0] == []  # MXFP4 itself is fine


def test_the_sharded_fsdp_load_refuses_an_mxfp4_checkpoint(checkpoint):
    from hone.config import parse_config
    from hone.models.sharded_load import load_model_sharded

    cfg = parse_config(
        {
            "model": {"path": str(checkpoint.path), "dtype": "float32"},
            "data": {"datasets": [{"path": "unused.jsonl", "type": "completion"}]},
            "adapter": {"type": "lora"},
        }
    )
    with pytest.raises(ModelError, match="quant_method 'mxfp4'.*distributed.strategy: fsdp"):
        load_model_sharded(cfg, tokenizer=None, device=CPU, shard=lambda model: None)


def _run_config(path: Path, adapter: dict):
    from hone.config import parse_config

    return parse_config(
        {
            "model": {"path": str(path), "dtype": "float32", "attn_implementation": "eager"},
            "data": {"datasets": [{"path": "unused.jsonl", "type": "completion"}]},
            "adapter": adapter,
        }
    )


@pytest.mark.parametrize(
    ("implementation", "adapter", "says"),
    [
        ("eager", {"type": "lora"}, "model.experts_implementation: 'eager' cannot compute MXFP4 experts"),
        ("grouped_mm", {"type": "lora"}, "model.experts_implementation: 'grouped_mm' cannot compute MXFP4 experts"),
        ("hone", {"type": "none"}, "adapter.type: a full fine-tune cannot train MXFP4 experts"),
    ],
)
def test_a_run_that_cannot_train_the_mxfp4_experts_is_refused_as_it_loads(checkpoint, implementation, adapter, says):
    from hone.models.loader import load_model
    from hone.testing import tiny_tokenizer

    cfg = _run_config(checkpoint.path, adapter)
    with pytest.raises(ModelError, match=says):
        load_model(cfg, tiny_tokenizer(), CPU, before_adapter=lambda base: set_experts_implementation(base, implementation))


def test_the_lora_run_loads_with_hone_experts(checkpoint):
    from hone.models.loader import load_model
    from hone.testing import tiny_tokenizer

    cfg = _run_config(checkpoint.path, {"type": "lora", "lora_target_modules": ["q_proj", "experts"]})
    loaded = load_model(cfg, tiny_tokenizer(), CPU, before_adapter=lambda base: set_experts_implementation(base, "hone"))
    assert sum("experts" in n and p.requires_grad for n, p in loaded.model.named_parameters()) == 8
    assert not any(is_placeholder(p) for p in loaded.model.parameters() if p.requires_grad)


def test_under_expert_parallelism_a_rank_keeps_its_block_of_the_shipped_mxfp4_experts(checkpoint):
    """``distributed.expert_parallel: 2``, rank 1, an MXFP4 checkpoint: the plan's base transforms
    (record the shipped MXFP4, hone's experts, the split) leave each experts module the file's
    blocks, scales and biases of experts 4..7 and placeholders of the block's shape, split before
    anything is read (the loader applies the plan's as-drawn hook on the meta device, then reads the
    block's rows); PEFT then makes expert LoRA factors for those 4 experts."""
    from hone.config import parse_config
    from hone.models.experts.backend import EXPERT_OVERFLOW_BUFFER, EXPERT_SHARD_ATTR, experts_modules
    from hone.models.loader import load_model
    from hone.runtime.world import World
    from hone.testing import tiny_tokenizer
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    cfg = parse_config(
        {
            "model": {"path": str(checkpoint.path), "dtype": "float32", "attn_implementation": "eager"},
            "data": {"datasets": [{"path": "unused.jsonl", "type": "completion"}]},
            "adapter": {"type": "lora", "lora_r": 2, "lora_target_modules": ["q_proj", "experts"]},
            "distributed": {"expert_parallel": 2, "expert_capacity_factor": 1.0},
        }
    )
    facts = RunFacts(CPU, world=World(1, 2, 1))
    plan = plan_optimizations(cfg, facts)
    assert {"quantize", "experts", "expert_parallel"} <= set(plan.names)
    split_as_read = []

    def base_stage(base):
        split_as_read.extend(getattr(m, EXPERT_SHARD_ATTR, None) is not None for _, m in experts_modules(base))
        plan.apply(base, "base", cfg, facts)

    loaded = load_model(cfg, tiny_tokenizer(), CPU, before_adapter=base_stage, as_drawn=plan.as_drawn(cfg, facts))
    # the loader split each experts module on the meta device and read only its block (run.py passes as_drawn)
    assert split_as_read and all(split_as_read)
    files = load_file(str(checkpoint.path / "model.safetensors"))
    modules = experts_modules(loaded.model.get_base_model())
    assert modules
    for name, module in modules:
        key = name.replace(".base_layer", "")  # the module PEFT wraps, by its checkpoint name
        assert getattr(module, EXPERT_SHARD_ATTR).rank == 1, name
        assert getattr(module, EXPERT_OVERFLOW_BUFFER).device == CPU  # the overflow counter made while split on meta
        for projection, (blocks, scales) in mxfp4_weights(module).items():
            assert torch.equal(blocks, files[f"{key}.{projection}_blocks"][4:]), (key, projection)
            assert torch.equal(scales, files[f"{key}.{projection}_scales"][4:]), (key, projection)
            assert is_placeholder(getattr(module, projection)) and getattr(module, projection).shape[0] == 4
            torch.testing.assert_close(getattr(module, f"{projection}_bias"), files[f"{key}.{projection}_bias"][4:])
    expert_a = [p for n, p in loaded.model.named_parameters() if "experts" in n and "lora_A" in n]
    assert expert_a and all(p.shape[0] == 2 * 4 for p in expert_a)
