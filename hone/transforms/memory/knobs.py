"""The vocabulary of what an estimate is asked about: the checkpointing policies and the losses."""

from typing import Literal

Checkpointing = Literal["none", "full", "selective", "offload"]
LossKind = Literal["standard", "fused_linear_ce"]
#: From the fastest step to the leanest.
POLICIES: tuple[Checkpointing, ...] = ("none", "selective", "full", "offload")
