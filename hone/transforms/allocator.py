"""The CUDA caching allocator's settings for a run: expandable segments at long context.

As a transform (:data:`ALLOCATOR`) it only records the choice: the setting must be in place
before CUDA starts, so :func:`configure_allocator` applies it first thing, outside the plan.

Why: torch's caching allocator carves tensors out of segments it reserved earlier and never
merges two segments. At long context the step allocates tensors of many GiB whose sizes change
from one op to the next (a layer input, the MLP's ``[tokens x intermediate]`` activations, the
recomputed layer's q/k/v, the host copies coming back), so free space ends up split across
segments too small for the next request: qwen3-8b LoRA at 256K tokens (offload, fused loss)
stopped with 47 GiB allocated and 31 GiB reserved but unusable (H100, session 7), and at 64K the
process reserved 38.9 GiB for a 27.0 GiB peak. With ``expandable_segments`` the allocator maps
more physical memory into one growing virtual segment instead, so freed memory is reusable
whatever its size (torch's documented remedy for exactly this out-of-memory message).

The setting is read when CUDA is first initialised, so :func:`configure_allocator` runs before
anything touches the GPU (the first thing :func:`hone.train.run.run_training` does). A value the
user put in ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` is theirs and stays untouched.
The choice itself (:func:`allocator_choice`) reads only the config and the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hone.transforms.base import PlanContext, Transform

if TYPE_CHECKING:
    from torch import nn

    from hone.config import HoneConfig

#: Environment variables torch reads its allocator settings from (the second is the newer,
#: device-neutral name).
ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

#: ``memory.expandable_segments: auto`` turns them on from this many tokens per micro-batch: a
#: qwen3-8b hidden state is then 256 MiB and an MLP activation 768 MiB, where fragmentation
#: starts to cost whole GiB (measured: 11.9 GiB reserved unused at 64K, 31 GiB at 256K).
LONG_CONTEXT_TOKENS = 32_768

SETTING = "expandable_segments:True"


@dataclass(frozen=True)
class AllocatorChoice:
    """Whether the run asks for expandable segments, and why (for the plan and the run log)."""

    expandable: bool
    why: str
    user_setting: str | None = None  # what the environment already says, left as it is

    def record(self) -> dict[str, object]:
        return {"expandable_segments": self.expandable, "why": self.why, "environment": self.user_setting}


#: The value this process's own :func:`configure_allocator` put in the environment (the bench
#: worker configures before it touches CUDA, then ``run_training`` again): not the user's.
_SET_HERE: str | None = None


def _user_setting() -> str | None:
    for name in ALLOC_ENV:
        value = os.environ.get(name)
        if value and not (name == ALLOC_ENV[0] and value == _SET_HERE):
            return f"{name}={value}"
    return None


def allocator_choice(cfg: HoneConfig, device_type: str) -> AllocatorChoice:
    """What ``memory.expandable_segments`` means for this run on ``device_type``."""
    asked = cfg.memory.expandable_segments
    user = _user_setting()
    if device_type != "cuda":
        return AllocatorChoice(False, f"memory.expandable_segments: {_word(asked)}: only CUDA's allocator has them", user)
    if user is not None:
        return AllocatorChoice(
            "expandable_segments:true" in user.lower(),
            f"the environment sets the allocator ({user}); hone leaves it as it is",
            user,
        )
    if asked != "auto":
        return AllocatorChoice(bool(asked), f"memory.expandable_segments: {_word(asked)}")
    tokens = cfg.micro_batch_tokens_per_rank()
    if tokens >= LONG_CONTEXT_TOKENS:
        return AllocatorChoice(
            True,
            f"memory.expandable_segments: auto: {tokens:,} tokens a micro-batch (>= {LONG_CONTEXT_TOKENS:,}): GiB-sized "
            "activations of changing sizes would fragment the allocator's segments",
        )
    return AllocatorChoice(False, f"memory.expandable_segments: auto: {tokens:,} tokens a micro-batch, torch's default allocator")


def configure_allocator(cfg: HoneConfig, device_type: str) -> AllocatorChoice:
    """Apply :func:`allocator_choice` to this process: through the environment while CUDA is not
    initialised yet (the normal case), else through torch's allocator-settings call, which
    affects the segments reserved from then on."""
    choice = allocator_choice(cfg, device_type)
    if not choice.expandable or choice.user_setting is not None:
        return choice
    import torch

    if not torch.cuda.is_initialized():
        global _SET_HERE
        os.environ[ALLOC_ENV[0]] = _SET_HERE = SETTING
        return choice
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return AllocatorChoice(False, choice.why + "; CUDA was already initialised and this torch cannot change the setting")
    setter(SETTING)
    return choice


def _word(value: object) -> str:
    return "true" if value is True else "false" if value is False else str(value)


def _record(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    decided = ctx.decided
    return AllocatorChoice(decided.expandable_segments, decided.allocator_why, decided.allocator_environment).record()


ALLOCATOR = Transform(
    name="allocator",
    switch="memory.expandable_segments",
    # configured by run_training before CUDA starts (configure_allocator); recorded here
    wanted=lambda ctx: ctx.decided.expandable_segments,
    why=lambda ctx: ctx.decided.allocator_why,
    stage="base",
    model=_record,
    label=lambda details: "allocator (expandable segments)",
)
