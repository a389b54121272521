"""The float8 all-gather's cast-once shard (hone.transforms.fp8_cast_once): the bits it caches are
torchao's, it hands them over only while the shard and the scale are the ones they came from, and
FSDP2's padding, views and copies keep the behaviour. The sharded training itself (2 gloo ranks,
against the unsharded model, and a killed run resuming) is tests/distributed/test_fp8_gloo.py and
tests/distributed/test_fp8_fsdp_train.py."""

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

from torchao.float8.float8_scaling_utils import hp_tensor_and_scale_to_float8  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig  # noqa: E402

from hone.transforms.fp8 import convert_full_finetune  # noqa: E402
from hone.transforms.fp8_cast_once import Float8CastOnceWeight, cast_all, cast_shards, float8_bits  # noqa: E402

F8 = torch.float8_e4m3fn


def _weight(seed: int = 0, rows: int = 32, cols: int = 48) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 3).to(torch.bfloat16)


def _torchao_bits(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return hp_tensor_and_scale_to_float8(tensor, scale, F8, LinearMMConfig(), GemmInputRole.WEIGHT)._data


def _wrapped(tensor: torch.Tensor, scale: torch.Tensor | None) -> Float8CastOnceWeight:
    return Float8CastOnceWeight(tensor, LinearMMConfig(), F8, scale)


def test_the_cast_is_torchaos_including_values_it_saturates():
    w = _weight()
    scale = torch.tensor(torch.finfo(F8).max / w.float().abs().max().item() * 4)  # a quarter of the values overflow
    bits = float8_bits(w, scale, F8)
    assert bits.dtype == F8 and (bits.float().abs() == torch.finfo(F8).max).any()
    assert torch.equal(bits.view(torch.uint8), _torchao_bits(w, scale).view(torch.uint8))


def test_the_one_call_casts_every_shard_with_its_own_scale():
    shards = [_weight(7, 32, 48), _weight(8, 16, 48), _weight(9, 48, 16)]
    scales = torch.tensor([448.0 / s.float().abs().max().item() * f for s, f in zip(shards, (1.0, 3.0, 0.5))])
    got = cast_all(shards, scales, F8)
    for shard, scale, bits in zip(shards, scales, got, strict=True):
        assert bits.shape == shard.shape
        assert torch.equal(bits.view(torch.uint8), _torchao_bits(shard, scale).view(torch.uint8))


def test_the_hook_hands_over_the_cached_bits_only_for_the_shard_and_scale_they_came_from():
    w = _weight(1)
    scale = torch.tensor(torch.finfo(F8).max / w.float().abs().max().item())
    shard = _wrapped(w.clone(), scale)
    shard.keep_cast(float8_bits(shard._tensor, scale, F8))
    (bits,), (used,) = shard.fsdp_pre_all_gather(None)
    assert bits is shard._cast.bits and used is scale
    assert torch.equal(bits.view(torch.uint8), _torchao_bits(w, scale).view(torch.uint8))

    with torch.no_grad():
        shard._tensor.add_(torch.full_like(w, 0.5))  # a checkpoint loaded into the shard's storage
    (fresh,), _ = shard.fsdp_pre_all_gather(None)
    assert fresh is not bits
    assert torch.equal(fresh.view(torch.uint8), _torchao_bits(shard._tensor, scale).view(torch.uint8))
    assert not torch.equal(fresh.view(torch.uint8), bits.view(torch.uint8))

    shard.keep_cast(float8_bits(shard._tensor, scale, F8))
    with torch.no_grad():
        shard.mul_(0.5)  # an optimizer step (through the wrapper: no version of the inner tensor moves)...
    shard._precomputed_scale = scale * 2  # ...and the scales it precomputes, before the cast
    (rescaled,), (used,) = shard.fsdp_pre_all_gather(None)
    assert rescaled is not shard._cast.bits and used is shard._precomputed_scale
    assert torch.equal(rescaled.view(torch.uint8), _torchao_bits(shard._tensor, scale * 2).view(torch.uint8))


def test_a_shard_without_a_scale_is_not_cast():
    shard = _wrapped(_weight(2), None)
    shard.keep_cast(float8_bits(shard._tensor, torch.tensor(1.0), F8))
    assert shard._cast is None  # bits with no scale to hand over beside them are not kept


def test_fsdp2s_padding_views_and_copies_keep_the_cast_once_class():
    shard = _wrapped(_weight(3), None)
    padded = shard.new_zeros((40, 48))
    padded.narrow(0, 0, 32).copy_(shard)
    for t in (padded, padded.narrow(0, 0, 32), padded.view(-1), shard.detach()):
        assert type(t) is Float8CastOnceWeight, type(t)
    assert torch.equal(padded._tensor[:32], shard._tensor) and not padded._tensor[32:].any()
    names, spec = shard.__tensor_flatten__()
    again = Float8CastOnceWeight.__tensor_unflatten__({n: getattr(shard, n) for n in names}, spec, shard.shape, shard.stride())
    assert type(again) is Float8CastOnceWeight and again._tensor is shard._tensor


def _net() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).to(torch.bfloat16)


def test_only_float8_all_gather_weights_are_rewrapped_and_unsharded_weights_are_not_cast():
    net = _net()
    details = convert_full_finetune(net, "tensorwise", fsdp_float8_all_gather=True, emulate=True)
    assert details["cast_once_per_step"] == 2
    assert all(isinstance(m.weight, nn.Parameter) and type(m.weight) is Float8CastOnceWeight for m in (net[0], net[2]))
    assert cast_shards(net) == 0  # no DTensor shards: nothing FSDP2 gathers
    plain = _net()
    assert convert_full_finetune(plain, "tensorwise", emulate=True)["cast_once_per_step"] == 0
    assert not isinstance(plain[0].weight, Float8CastOnceWeight)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    torch.testing.assert_close(net(x), plain(x))  # unsharded, the wrapper computes as torchao's layer
