"""Saving under expert parallelism, 2 gloo processes on the CPU, fp32, a tiny qwen3-moe (8 experts).

Each rank slices every experts module to its 4 experts (``hone_expert_shard``, as the
expert-parallel transform does) before PEFT attaches LoRA on attention and experts, so its expert
LoRA factors are per-rank (``lora_A [r * 4, in]``, ``lora_B [out, r * 4]``). The rank's factors
are set to its block of a one-process model's random factors. Then:

- the final adapter both ranks save is the one-process model's adapter, tensor for tensor, and
  loads with ``PeftModel.from_pretrained`` on the unsharded base, where PEFT's
  ``merge_and_unload`` (what ``hone merge`` runs) gives the one-process model's merged weights;
- a full fine-tune's final model is the one-process model's save_pretrained directory;
- a step checkpoint written by the 2 ranks (after an AdamW step with rank-specific gradients)
  holds the whole tensors, restores each rank's weight and moment blocks exactly on 2 fresh
  ranks, and resumes on one process (2 -> 1) with the whole tensors;
- a one-process checkpoint resumes on 2 ranks (1 -> 2), each with its block; a full fine-tune's
  checkpoint (the 3-D expert weights with their moments) round-trips too.
"""

import pytest
import torch
from fsdp_harness import save, spawn
from safetensors.torch import load_file

from hone.models.experts.parallel import shard_experts

PRESET, EXPERTS, WORLD, R = "tiny-qwen3-moe", 8, 2, 2
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _base(seed: int = 0):
    from hone.testing import tiny_model, tiny_tokenizer

    return tiny_model(PRESET, tiny_tokenizer(), seed=seed)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=R, lora_alpha=4, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_TARGETS)
    return get_peft_model(model, config)


def reference_lora():
    """The one-process model with random LoRA factors (A and B) drawn from a fixed seed."""
    model = _lora(_base())
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
    return model


def rank_block(name: str, whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """A rank's block of a whole expert LoRA factor, from PEFT's layout: A viewed
    ``[E, r, in]`` (experts major), B viewed ``[out, r, E]`` (experts minor)."""
    local = EXPERTS // size
    first = rank * local
    if "lora_A" in name:
        return whole.reshape(EXPERTS, -1, whole.shape[-1])[first : first + local].reshape(-1, whole.shape[-1])
    out = whole.shape[0]
    return whole.reshape(out, -1, EXPERTS)[:, :, first : first + local].reshape(out, -1)


def is_expert_factor(name: str) -> bool:
    return ".experts." in name and "lora_" in name


def sharded_lora(rank: int, size: int):
    """This rank's model: experts sliced, then PEFT, then its block of the reference factors."""
    reference = dict(reference_lora().named_parameters())
    model = _base()
    shard_experts(model, size, rank)
    model = _lora(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                want = reference[name].detach()
                param.copy_(rank_block(name, want, rank, size) if is_expert_factor(name) else want)
    return model


def _final_worker(rank: int, out) -> None:
    from hone.config.adapter import AdapterConfig
    from hone.models.experts.lora import expert_lora_factors
    from hone.models.save import save_final

    model = sharded_lora(rank, WORLD)
    wrapper = model.base_model.model.model.layers[0].mlp.experts  # down_proj's wrapper (outermost)
    a, b = expert_lora_factors(wrapper, "default")
    save({"A": a.detach().clone(), "B": b.detach().clone()}, out / f"factors-{rank}.pt")
    save_final(model, None, out / "final", AdapterConfig(type="lora"))

    full = _base()
    shard_experts(full, WORLD, rank)
    save_final(full, None, out / "final-full", AdapterConfig(type="none"))


@pytest.fixture(scope="module")
def finals(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_final")
    spawn(_final_worker, WORLD, out, timeout_s=300)
    return out


def test_the_test_slices_peft_factors_as_hone_reads_them(finals):
    from hone.models.experts.lora import expert_lora_factors

    wrapper = reference_lora().base_model.model.model.layers[0].mlp.experts
    a, b = expert_lora_factors(wrapper, "default")
    for rank in range(WORLD):
        got = torch.load(finals / f"factors-{rank}.pt")
        block = slice(rank * EXPERTS // WORLD, (rank + 1) * EXPERTS // WORLD)
        torch.testing.assert_close(got["A"], a[block].detach(), rtol=0, atol=0)
        torch.testing.assert_close(got["B"], b[block].detach(), rtol=0, atol=0)


def test_the_final_adapter_is_the_one_process_adapter(finals, tmp_path):
    from peft import PeftModel

    reference = reference_lora()
    reference.save_pretrained(str(tmp_path / "ref"), safe_serialization=True, save_embedding_layers=False)
    want = load_file(str(tmp_path / "ref" / "adapter_model.safetensors"))
    got = load_file(str(finals / "final" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want)
    assert any(".experts." in k for k in got)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    loaded = PeftModel.from_pretrained(_base(), str(finals / "final"))
    ref_params = dict(reference.named_parameters())
    for name, param in loaded.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(param, ref_params[name], rtol=0, atol=0, msg=name)
    # what hone merge does: PEFT's merge_and_unload
    merged, want_merged = loaded.merge_and_unload().state_dict(), reference.merge_and_unload().state_dict()
    for key in want_merged:
        torch.testing.assert_close(merged[key], want_merged[key], rtol=0, atol=0, msg=key)
    down = "model.layers.0.mlp.experts.down_proj"
    assert not torch.equal(want_merged[down], _base().state_dict()[down])  # the experts' LoRA was merged in


def test_the_final_full_model_is_the_one_process_model(finals):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(finals / "final-full"), dtype=torch.float32)
    want = _base().state_dict()
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


# ---------------------------------------------------------------- step checkpoints


def _optimizer(model):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return optimizer, scheduler


def _blocks(model, optimizer) -> dict[str, torch.Tensor]:
    """Every trainable weight and its AdamW moments, by name."""
    found = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            found[name] = param.detach().clone()
            for key, value in optimizer.state.get(param, {}).items():
                if value.dim() > 0:
                    found[f"{name}:{key}"] = value.clone()
    return found


def _checkpoint_worker(rank: int, out) -> None:
    from hone.runtime.world import world_from_env
    from hone.train.checkpoint_io import RankZeroCheckpoints

    io = RankZeroCheckpoints(world_from_env())
    model = sharded_lora(rank, WORLD)
    optimizer, scheduler = _optimizer(model)
    shared, own = torch.Generator().manual_seed(100), torch.Generator().manual_seed(200 + rank)
    for name, param in model.named_parameters():  # replicated weights: the same gradient; expert blocks: their own
        if param.requires_grad:
            param.grad = torch.randn(param.shape, generator=own if is_expert_factor(name) else shared)
    optimizer.step()
    scheduler.step()
    save(_blocks(model, optimizer), out / f"saved-{rank}.pt")
    common = {"optimizer": optimizer, "scheduler": scheduler, "scaler": None}
    path = io.save(out / "run", 1, model=model, state={"step": 1}, keep=None, **common)
    save(_blocks(model, optimizer), out / f"after-save-{rank}.pt")  # saving must leave the run's state as it was
    optimizer.step()  # and the run goes on

    fresh = sharded_lora(rank, WORLD)
    optimizer, scheduler = _optimizer(fresh)
    state = io.load(path, model=fresh, optimizer=optimizer, scheduler=scheduler, scaler=None)
    assert state["step"] == 1
    save(_blocks(fresh, optimizer), out / f"restored-{rank}.pt")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_checkpoint")
    spawn(_checkpoint_worker, WORLD, out, timeout_s=300)
    return out


def test_a_checkpoint_of_2_ranks_restores_each_ranks_blocks_exactly(checkpoint):
    for rank in range(WORLD):
        saved = torch.load(checkpoint / f"saved-{rank}.pt")
        restored = torch.load(checkpoint / f"restored-{rank}.pt")
        assert sorted(restored) == sorted(saved)
        assert any(":exp_avg" in key and ".experts." in key for key in saved)
        for key in saved:
            torch.testing.assert_close(restored[key], saved[key], rtol=0, atol=0, msg=key)
    other = torch.load(checkpoint / "saved-1.pt")
    first = torch.load(checkpoint / "saved-0.pt")
    expert_key = next(k for k in first if is_expert_factor(k) and k.endswith(":exp_avg"))
    assert not torch.equal(first[expert_key], other[expert_key])  # the ranks' blocks differ


def test_saving_leaves_each_ranks_weights_and_moments_as_they_were(checkpoint):
    for rank in range(WORLD):
        saved, after = torch.load(checkpoint / f"saved-{rank}.pt"), torch.load(checkpoint / f"after-save-{rank}.pt")
        assert sorted(after) == sorted(saved)
        for key in saved:
            torch.testing.assert_close(after[key], saved[key], rtol=0, atol=0, msg=key)


def test_the_checkpoint_holds_every_expert_once(checkpoint):
    from hone.train.checkpoint import WEIGHTS_FILE

    weights = load_file(str(checkpoint / "run" / "checkpoints" / "step-1" / WEIGHTS_FILE))
    saved = [torch.load(checkpoint / f"saved-{rank}.pt") for rank in range(WORLD)]
    expert_names = [name for name in weights if is_expert_factor(name)]
    assert expert_names
    for name in expert_names:
        for rank in range(WORLD):
            torch.testing.assert_close(rank_block(name, weights[name], rank, WORLD), saved[rank][name], rtol=0, atol=0)


def test_a_checkpoint_of_2_ranks_resumes_on_one_process(checkpoint):
    from hone.train.checkpoint_io import RankZeroCheckpoints

    model = reference_lora()
    optimizer, scheduler = _optimizer(model)
    path = checkpoint / "run" / "checkpoints" / "step-1"
    RankZeroCheckpoints().load(path, model=model, optimizer=optimizer, scheduler=scheduler, scaler=None)
    got = _blocks(model, optimizer)
    saved = [torch.load(checkpoint / f"saved-{rank}.pt") for rank in range(WORLD)]
    for key, value in got.items():
        name = key.split(":")[0]
        if is_expert_factor(name):
            for rank in range(WORLD):
                torch.testing.assert_close(rank_block(name, value, rank, WORLD), saved[rank][key], rtol=0, atol=0, msg=key)
        else:
            torch.testing.assert_close(value, saved[0][key], rtol=0, atol=0, msg=key)


def _one_process_checkpoint(out) -> dict[str, torch.Tensor]:
    """A one-process run's checkpoint after an AdamW step; its weights and moments by name."""
    from hone.train.checkpoint_io import RankZeroCheckpoints

    model = reference_lora()
    optimizer, scheduler = _optimizer(model)
    gen = torch.Generator().manual_seed(300)
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.randn(param.shape, generator=gen)
    optimizer.step()
    RankZeroCheckpoints().save(
        out, 1, model=model, optimizer=optimizer, scheduler=scheduler, scaler=None, state={"step": 1}, keep=None
    )
    return _blocks(model, optimizer)


def _resume_worker(rank: int, path, out) -> None:
    from hone.runtime.world import world_from_env
    from hone.train.checkpoint_io import RankZeroCheckpoints

    model = sharded_lora(rank, WORLD)
    optimizer, scheduler = _optimizer(model)
    RankZeroCheckpoints(world_from_env()).load(path, model=model, optimizer=optimizer, scheduler=scheduler, scaler=None)
    save(_blocks(model, optimizer), out / f"resumed-{rank}.pt")


def test_a_one_process_checkpoint_resumes_on_2_ranks(tmp_path):
    whole = _one_process_checkpoint(tmp_path / "run")
    spawn(_resume_worker, WORLD, tmp_path / "run" / "checkpoints" / "step-1", tmp_path, timeout_s=300)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"resumed-{rank}.pt")
        assert sorted(got) == sorted(whole)
        for key, value in whole.items():
            want = rank_block(key.split(":")[0], value, rank, WORLD) if is_expert_factor(key.split(":")[0]) else value
            torch.testing.assert_close(got[key], want, rtol=0, atol=0, msg=key)


def _full_worker(rank: int, out) -> None:
    from hone.runtime.world import world_from_env
    from hone.train.checkpoint_io import RankZeroCheckpoints

    io = RankZeroCheckpoints(world_from_env())
    model = _base()
    shard_experts(model, WORLD, rank)
    optimizer, scheduler = _optimizer(model)
    shared, own = torch.Generator().manual_seed(400), torch.Generator().manual_seed(500 + rank)
    for name, param in model.named_parameters():
        param.grad = torch.randn(param.shape, generator=own if ".experts." in name else shared)
    optimizer.step()
    save(_blocks(model, optimizer), out / f"saved-{rank}.pt")
    common = {"optimizer": optimizer, "scheduler": scheduler, "scaler": None}
    path = io.save(out / "run", 1, model=model, state={"step": 1}, keep=None, **common)
    fresh = _base(seed=1)
    shard_experts(fresh, WORLD, rank)
    optimizer, scheduler = _optimizer(fresh)
    io.load(path, model=fresh, optimizer=optimizer, scheduler=scheduler, scaler=None)
    save(_blocks(fresh, optimizer), out / f"restored-{rank}.pt")


def test_a_full_fine_tune_checkpoint_restores_each_ranks_expert_weights_and_moments(tmp_path):
    from hone.train.checkpoint import WEIGHTS_FILE

    spawn(_full_worker, WORLD, tmp_path, timeout_s=300)
    weights = load_file(str(tmp_path / "run" / "checkpoints" / "step-1" / WEIGHTS_FILE))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert weights[name].shape[0] == EXPERTS
    for rank in range(WORLD):
        saved, restored = torch.load(tmp_path / f"saved-{rank}.pt"), torch.load(tmp_path / f"restored-{rank}.pt")
        assert sorted(restored) == sorted(saved) and f"{name}:exp_avg_sq" in saved
        for key in saved:
            torch.testing.assert_close(restored[key], saved[key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(weights[name][rank * 4 : rank * 4 + 4], saved[name], rtol=0, atol=0)


def test_a_checkpoint_of_another_expert_count_is_refused_by_name(tmp_path):
    from peft import LoraConfig, get_peft_model

    from hone.testing import tiny_model, tiny_tokenizer
    from hone.train.checkpoint_io import RankZeroCheckpoints
    from hone.train.expert_checkpoint import ExpertCheckpointError

    config = LoraConfig(r=R, lora_alpha=4, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_TARGETS)
    other = get_peft_model(tiny_model(PRESET, tiny_tokenizer(), num_experts=4), config)  # 4 experts, not 8
    optimizer, scheduler = _optimizer(other)
    path = RankZeroCheckpoints().save(
        tmp_path, 1, model=other, optimizer=optimizer, scheduler=scheduler, scaler=None, state={"step": 1}, keep=None
    )
    model = sharded_lora(0, WORLD)  # rank 0 of 2 reads it (no collective on load)
    optimizer, scheduler = _optimizer(model)
    with pytest.raises(ExpertCheckpointError, match=r"lora_[AB]\.default\.weight' has shape .* over 8 experts has"):
        RankZeroCheckpoints().load(path, model=model, optimizer=optimizer, scheduler=scheduler, scaler=None)
