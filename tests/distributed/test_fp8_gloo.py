"""Float8 across 2 gloo processes on the CPU (where torch's ``_scaled_mm`` and torchao's emulated
float8 both run): DDP wraps a LoRA layer on a float8 frozen base (its float8 buffers, kept as
uint8 bytes, survive DDP's broadcast at wrap time) and sums its LoRA gradients; FSDP2 with
torchao's float8 all-gather (tensorwise) computes each weight's amax over the whole mesh, so a
sharded step gives the unsharded step's loss and weights."""

import pytest
import torch
from fsdp_harness import full, save, spawn
from torch import nn

from hone.testing import OneProjection

WORLD = 2


def _lora_layer():
    from peft import LoraConfig, get_peft_model

    from hone.transforms.fp8 import Fp8FrozenLinear

    torch.manual_seed(0)
    base = nn.Linear(64, 32)
    layer = get_peft_model(OneProjection(base), LoraConfig(r=4, lora_alpha=8, target_modules=["proj"])).base_model.model.proj
    nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    layer.base_layer = Fp8FrozenLinear(base, "rowwise")
    return layer


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(10 + rank))


def _ddp(rank: int, out) -> None:
    from hone.runtime.step import StepModule
    from hone.transforms.data_parallel import wrap_ddp

    layer = _lora_layer()
    if rank == 1:  # a different float8 copy: DDP's broadcast at wrap time must replace it
        layer.base_layer.w_q.zero_()
    step = wrap_ddp(StepModule(layer))
    step.module(_inputs(rank)).pow(2).sum().backward()
    if rank == 0:
        save({n: full(p.grad) for n, p in layer.named_parameters() if p.grad is not None}, out)


def test_ddp_sums_lora_gradients_over_a_float8_base(tmp_path):
    out = tmp_path / "ddp.pt"
    spawn(_ddp, WORLD, out)
    got = torch.load(out)
    layer = _lora_layer()
    for rank in range(WORLD):
        layer(_inputs(rank)).pow(2).sum().backward()
    want = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    assert set(got) == set(want) == {"lora_A.default.weight", "lora_B.default.weight"}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)


def _net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


def _train(net, batches, precompute) -> list[float]:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for x in batches:
        loss = net(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        precompute(net)
        losses.append(loss.item())
    return losses


def _batches():
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(8, 64, generator=gen) for _ in range(3)]


def _fsdp(rank: int, out) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hone.transforms.fp8 import convert_full_finetune, precompute_scales

    net = _net()
    details = convert_full_finetune(net, "tensorwise", fsdp_float8_all_gather=True, emulate=True)
    assert details["fsdp_float8_all_gather"] and details["converted"] == 2
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    losses = _train(net, _batches(), precompute_scales)  # every rank the same batch: the unsharded step
    weights = {n: full(p) for n, p in net.named_parameters()}
    if rank == 0:
        save({"losses": losses, "weights": weights}, out)


def test_fsdp2_float8_all_gather_steps_like_the_unsharded_model(tmp_path):
    from hone.transforms.fp8 import convert_full_finetune

    out = tmp_path / "fsdp.pt"
    spawn(_fsdp, WORLD, out)
    got = torch.load(out)
    net = _net()
    convert_full_finetune(net, "tensorwise", emulate=True)
    # FSDP2 averages the gradients of the two ranks' identical batches: the unsharded gradient
    want = _train(net, _batches(), lambda net: None)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for name, param in net.named_parameters():
        torch.testing.assert_close(got["weights"][name.replace("_orig_mod.", "")], param.detach(), rtol=1e-5, atol=1e-6)


def _lopsided_net():
    """A float8 linear whose weight rows 0-15 (rank 0's shard under FSDP2) are 100x smaller than
    rows 16-31 (rank 1's), the whole weight's amax 3.0 in rank 1's shard."""
    torch.manual_seed(2)
    # with biases: gloo has no float8 type, and float8 weights gathered beside other dtypes go as bytes
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    with torch.no_grad():
        net[0].weight.uniform_(-1, 1)
        net[0].weight[:16] *= 0.01
        net[0].weight[20, 5] = 3.0
    return net


def _amax(rank: int, out) -> None:
    import copy
    import pickle

    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hone.transforms.fp8 import convert_full_finetune, precompute_scales

    net = _lopsided_net()
    convert_full_finetune(net, "tensorwise", fsdp_float8_all_gather=True, emulate=True)
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(net, mesh=mesh)  # the root only: net[0] stays torchao's Float8Linear, its weight a DTensor
    layer = net[0]
    shard = layer.weight._local_tensor  # the object FSDP2 calls the hooks on (FSDPParam._sharded_local_tensor)
    # the scale FSDP2's pre-all-gather hook casts this rank's shard with (the mesh handed at the call)
    _, (hook_scale,) = shard.fsdp_pre_all_gather(mesh)
    precompute_scales(net)  # all layers' scales in one all-reduce and each shard cast, as after each optimizer step
    (bits,), (precomputed,) = shard.fsdp_pre_all_gather(mesh)
    cached = shard._cast is not None and bits is shard._cast.bits
    # the float8 parts hold no process group or mesh: the copy of the sharded layer is torchao's, whole
    twin = copy.deepcopy(layer)
    groups = [v for m in (layer, twin) for v in vars(m).values() if isinstance(v, (DeviceMesh, torch.distributed.ProcessGroup))]
    pickle.loads(pickle.dumps((shard, layer.config)))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(7))
    y = net(x)  # the root stays unsharded after its forward: copied above, while sharded
    if rank == 0:
        save(
            {
                "local_amax": shard.abs().max().item(),
                "hook_scale": hook_scale.item(),
                "precomputed": precomputed.item(),
                "y": y.detach(),
                "twin": type(twin.weight.to_local()).__name__,
                "groups": len(groups),
                "cached": cached,
            },
            out,
        )


def test_the_amax_of_a_sharded_float8_weight_is_the_whole_weights(tmp_path):
    """torchao reduces a sharded weight's amax over the mesh FSDP2 hands its hooks (the group that
    owns the weight), never over a group stored on the module: rank 0, whose shard's amax is
    ~0.01, casts it with the scale of the whole weight's amax (3.0), so the gathered float8
    weight is one tensor with one scale and the output is the unsharded layer's. The sharded
    layer deep-copies, and its float8 parts (the weight's shard, the recipe) pickle: they hold no
    process group (FSDP2's own state refuses deep copies and pickling of a sharded root, by design)."""
    from hone.transforms.fp8 import convert_full_finetune

    out = tmp_path / "amax.pt"
    spawn(_amax, WORLD, out)
    got = torch.load(out)
    want_scale = torch.finfo(torch.float8_e4m3fn).max / 3.0
    assert got["local_amax"] < 0.011  # rank 0's own shard: a local amax would give a scale ~300x larger
    assert got["hook_scale"] == pytest.approx(want_scale, rel=1e-6)
    assert got["precomputed"] == pytest.approx(want_scale, rel=1e-6)
    net = _lopsided_net()
    convert_full_finetune(net, "tensorwise", emulate=True)
    torch.testing.assert_close(got["y"], net(torch.randn(4, 64, generator=torch.Generator().manual_seed(7))).detach())
    assert got["twin"] == "Float8CastOnceWeight" and got["groups"] == 0
    assert got["cached"]  # the gather after the precomputation hands over the shard cast there


def _buffers(rank: int, out) -> None:
    from hone.transforms.data_parallel import broadcast_buffers_once

    module = nn.Module()
    module.register_buffer("float8_bytes", torch.full((8,), rank + 1, dtype=torch.uint8), persistent=False)
    module.register_buffer("own", torch.full((3,), float(rank + 1)))
    broadcast_buffers_once(module, {"own"}, torch.distributed.group.WORLD)
    save({"float8_bytes": module.float8_bytes.clone(), "own": module.own.clone()}, out / f"{rank}.pt")


def test_buffers_are_rank_0_s_once_where_ddp_skips_them_at_construction(tmp_path):
    """torch < 2.13's DDP with ``broadcast_buffers=False`` never syncs buffers, not even at
    construction: hone broadcasts them once itself (a float8 copy quantized before the weights
    were broadcast would otherwise differ per rank); buffers DDP must ignore stay each rank's."""
    spawn(_buffers, WORLD, tmp_path)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(got["float8_bytes"], torch.full((8,), 1, dtype=torch.uint8)), rank
        assert torch.equal(got["own"], torch.full((3,), float(rank + 1))), rank
