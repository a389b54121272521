"""DDP around regionally compiled layers runs with Dynamo's DDP optimizer off, and only while it
runs (hone/transforms/data_parallel.py: its bucket split of a layer's graph broke Inductor on an
expert-parallel layer with torch 2.11, and a layer's graph needs no split to overlap)."""

import torch
from torch import nn

from hone.transforms.data_parallel import WholeLayerGraphs


class _Records(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))
        self.seen: list[object] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch._dynamo.config.optimize_ddp)
        return (self.weight * x).sum()


def test_the_ddp_optimizer_is_off_inside_the_call_and_restored_after():
    before = torch._dynamo.config.optimize_ddp
    inner = _Records()
    wrapped = WholeLayerGraphs(inner)
    x = torch.randn(3)
    out = wrapped(x)
    assert inner.seen == [False]
    assert torch._dynamo.config.optimize_ddp == before
    torch.testing.assert_close(out, inner(x))  # the call itself is unchanged
    out.backward()
    torch.testing.assert_close(inner.weight.grad, x)
    assert list(wrapped.parameters()) == [inner.weight]
