"""Float8 across 2 gloo processes on the CPU (where torch's ``_scaled_mm`` and torchao's emulated
float8 both run): DDP wraps a LoRA layer on a float8 frozen base (its float8 buffers, kept as
uint8 bytes, survive DDP's broadcast at wrap time) and sums its LoRA gradients; FSDP2 with
torchao's float8 all-gather (tensorwise) computes each weight's amax over the whole mesh, so a
sharded step gives the unsharded step's loss and weights."""

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
