"""Where a fused experts tensor of a transformers 5 model lies in a checkpoint of one tensor per expert.

transformers 5 holds each MoE layer's experts fused: qwen3_moe (and the other models its
conversion mapping sends to ``qwen2_moe``: olmoe, qwen2_moe, ...) as ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``. Their Hugging Face checkpoints, and
transformers 5's own ``save_pretrained``, keep one tensor per expert
(``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj.weight`` ``[I, H]``,
``down_proj.weight`` ``[H, I]``); transformers fuses them as it loads
(``transformers/conversion_mapping.py``: ``WeightConverter`` with ``MergeModulelist(dim=0)``
then ``Concatenate(dim=1)``, gate before up). Readers that fill a model tensor by tensor (the
FSDP2 sharded load) use :data:`LAYOUTS` to assemble just the experts they need, in that order.
gpt-oss checkpoints store the experts fused already (``gate_up_proj`` ``[E, H, 2I]``, no
conversion), so they never reach this table.
"""

from collections.abc import Callable, Container
from dataclasses import dataclass

import torch

from hone.models.errors import ModelError


@dataclass(frozen=True)
class PerExpert:
    """A fused experts tensor ``<prefix><fused>`` kept as ``parts`` per expert (``{e}``: the expert):
    expert ``e``'s rows of the fused tensor are its parts concatenated along their dim 0, in order."""

    fused: str
    parts: tuple[str, ...]

    def sources(self, key: str) -> Callable[[int], list[str]]:
        """Expert -> the checkpoint keys of its parts, for the fused tensor ``key``."""
        prefix = key.removesuffix(self.fused)
        return lambda expert: [prefix + part.format(e=expert) for part in self.parts]


#: transformers' conversion mapping ``qwen2_moe`` (qwen3_moe, olmoe, ...). Not mixtral: its checkpoints
#: also rename the router (``block_sparse_moe.gate`` -> ``mlp.gate``), which a table of experts does not cover.
LAYOUTS = (
    PerExpert("mlp.experts.gate_up_proj", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
    PerExpert("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",)),
)


def per_expert_sources(key: str, available: Container[str]) -> Callable[[int], list[str]] | None:
    """Expert -> its part keys, for the fused tensor ``key`` stored one tensor per expert in a
    checkpoint holding ``available`` keys (the first layout whose expert 0 is there); None if none is."""
    for layout in LAYOUTS:
        if key.endswith("." + layout.fused) or key == layout.fused:
            sources = layout.sources(key)
            if all(part in available for part in sources(0)):
                return sources
    return None


def expert_rows(sources: Callable[[int], list[str]], first: int, count: int, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Rows ``[first, first + count)`` of the fused tensor (experts ``first`` onwards), each
    expert's parts (``read(key)``) concatenated along dim 0, stacked: as transformers fuses them."""
    experts: list[torch.Tensor] = []
    for expert in range(first, first + count):
        keys = sources(expert)
        parts = [read(key) for key in keys]
        joined = torch.cat(parts, dim=0) if len({tuple(p.shape[1:]) for p in parts}) == 1 else None
        if joined is None or (experts and joined.shape != experts[0].shape):
            found = ", ".join(f"'{key}' {tuple(part.shape)}" for key, part in zip(keys, parts, strict=True))
            want = f" (expert {first}'s make {tuple(experts[0].shape)})" if experts else ""
            raise ModelError(f"model.path: expert {expert}'s tensors do not make one expert of a fused tensor: {found}{want}")
        experts.append(joined)
    return torch.stack(experts)
