"""More than one process: how the model is replicated or sharded across ranks.

No torch here: the strategy is validated before anything is loaded. How many processes run is
not a config key: it is how the run was launched (``hone train CFG --nproc-per-node N`` or
``torchrun``), so the same config file trains on one GPU or on eight.
"""

from typing import Literal

from hone.config.base import Section

Strategy = Literal["auto", "none", "ddp", "fsdp"]


class DistributedConfig(Section):
    """Data parallelism over the processes ``torchrun`` starts (docs/distributed.md)."""

    strategy: Strategy = "auto"
    """``ddp``: every rank holds the whole model, gradients are all-reduced. ``fsdp``: PyTorch's
    FSDP2 (``fully_shard`` per decoder layer and at the root) shards parameters, gradients and
    optimizer state across ranks. ``none``: refuse to run on more than one process. ``auto``:
    one process trains alone; on several, FSDP2 where the training state (weights, gradients,
    optimizer) does not fit one device, DDP otherwise (the plan prints which and why)."""

    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters of a layer after its forward and gather them again
    for the backward (less memory, one more all-gather per layer). ``false`` keeps them."""

    cpu_offload: bool = False
    """FSDP2: keep sharded parameters, gradients and optimizer state in host memory (the
    optimizer steps on the CPU): full fine-tunes that do not fit the GPUs, at a large cost in
    speed."""
